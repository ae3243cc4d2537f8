"""What a model forward asks of a cache. The model never owns cache memory; the engine passes an object with
these methods (`qwen_mtp.cache.SequenceCache` for plain generation, the paged pools for the engine)."""

from __future__ import annotations

from typing import Protocol

import torch


class ForwardCache(Protocol):
    state_dtype: torch.dtype  # precision the SSM state is stored in

    def positions(self, num_tokens: int) -> torch.Tensor:
        """Positions [B, num_tokens] of the tokens about to be fed to the target model."""

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store k, v [B, KV, T, D] for attention layer `layer` after its cached context, then return causal
        attention of q [B, H, T, D] over the whole context: [B, H, T, D]."""

    def gdn_recurrent(self, num_tokens: int) -> bool:
        """Whether GDN layers run the token-by-token delta rule (decode, verify) rather than the chunked one."""

    def gdn_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv window [B, C, kernel-1], SSM state [B, Hv, dk, dv]) of GDN layer `layer`; None before prefill."""

    def set_gdn_state(self, layer: str, conv_inputs: torch.Tensor, states: torch.Tensor) -> None:
        """Record the layer's state after the tokens just processed.

        conv_inputs [B, C, n]: the most recent raw conv inputs, oldest first, ending at the last token (the
        recurrent path passes every input after the first of the window, so any accepted prefix's window can be
        selected later). states [B, S, Hv, dk, dv]: the SSM state after each of the last S tokens (S = T on the
        recurrent path, 1 on the chunked path)."""

    def advance(self, num_tokens: int) -> None:
        """The target model consumed `num_tokens` more tokens per sequence."""
