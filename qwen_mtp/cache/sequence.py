"""Dense caches for a fixed batch of sequences that advance together (no paging).

Used for plain single-batch generation and as the simple reference the paged engine is tested against. KV
grows by concatenation; GDN state is one row per sequence with a single slot, driven by the same ops as the
paged pools. The caller calls `advance` after each forward of the target model: the cache cannot tell a target
forward (which moves the sequences on) from an MTP-head forward over the same positions (which does not).
"""

from __future__ import annotations

import torch

from qwen_mtp.ops import conv as conv_ops
from qwen_mtp.ops import gdn as gdn_ops
from qwen_mtp.ops.attention import causal_attention


class SequenceCache:
    batch_invariant = False  # a fixed batch runs together from start to end: its rows never change company
    prefill_plans = False

    def __init__(self, batch: int, device: torch.device | str = "cpu", state_dtype: torch.dtype = torch.float32):
        self.batch = batch
        self.device = torch.device(device)
        self.state_dtype = state_dtype
        self.length = 0  # tokens the target model has consumed per sequence
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gdn: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (window [B,C,k-1], ssm [B,1,...])
        self._rows = torch.arange(batch, device=self.device)
        self._committed = torch.zeros(batch, dtype=torch.long, device=self.device)

    def positions(self, num_tokens: int) -> torch.Tensor:
        row = torch.arange(self.length, self.length + num_tokens, device=self.device)
        return row.expand(self.batch, num_tokens)

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if layer in self.kv:
            past_k, past_v = self.kv[layer]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.kv[layer] = (k, v)
        return causal_attention(q, k, v, scale)

    def sequences(self) -> list[tuple[slice, SequenceCache]]:
        return [(slice(None), self)]  # one row per sequence

    def gdn_recurrent(self, num_tokens: int) -> bool:
        # Hugging Face's rule: one token on top of a state runs the recurrence, anything else the chunked form.
        return num_tokens == 1 and self.length > 0

    def gdn_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if layer not in self.gdn:
            return None, None
        window, ssm = self.gdn[layer]
        return window, ssm[:, 0]

    def set_gdn_state(self, layer: str, window: torch.Tensor, ssm: torch.Tensor) -> None:
        self.gdn[layer] = (window.clone(), ssm[:, None].to(self.state_dtype))

    def gdn_conv_update(self, layer: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return conv_ops.conv_update_reference(x, weight, self.gdn[layer][0], self._rows, self._committed)

    def gdn_delta_rule(self, layer, q, k, v, a, b, A_log, dt_bias) -> torch.Tensor:  # noqa: N803
        ssm = self.gdn[layer][1]
        return gdn_ops.gdn_recurrent_reference(q, k, v, a, b, A_log, dt_bias, ssm, self._rows, self._committed)

    def advance(self, num_tokens: int) -> None:
        """The target model consumed `num_tokens` more tokens per sequence (call after each of its forwards)."""
        self.length += num_tokens
