"""What a model forward asks of a cache. The model never owns cache memory; the engine passes an object with
these methods (`qwen_mtp.cache.SequenceCache` for plain generation, the paged pools for the engine)."""

from __future__ import annotations

from typing import Protocol

import torch


class ForwardCache(Protocol):
    def positions(self, num_tokens: int) -> torch.Tensor:
        """Positions [B, num_tokens] of the tokens about to be fed to the target model."""

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store k, v [B, KV, T, D] for attention layer `layer` after its cached context, then return causal
        attention of q [B, H, T, D] over the whole context: [B, H, T, D]."""

    def gdn_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv window [B, C, kernel-1], SSM state [B, Hv, dk, dv]) of GDN layer `layer`; None before prefill."""

    def set_gdn_state(self, layer: str, window: torch.Tensor, ssm: torch.Tensor) -> None:
        """Record the state after the tokens just processed."""

    def advance(self, num_tokens: int) -> None:
        """The target model consumed `num_tokens` more tokens per sequence."""
