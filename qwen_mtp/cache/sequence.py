"""Dense caches for a fixed batch of sequences that advance together (no paging).

Used for plain single-batch generation and as the reference the paged engine must equal. KV grows by
concatenation, which is fine at this scale; the paged pools replace it for serving.
"""

from __future__ import annotations

import torch

from qwen_mtp.ops.attention import causal_attention


class SequenceCache:
    def __init__(self, batch: int, device: torch.device | str = "cpu", state_dtype: torch.dtype = torch.float32):
        self.batch = batch
        self.device = torch.device(device)
        self.state_dtype = state_dtype
        self.length = 0  # tokens the target model has consumed per sequence
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gdn: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self, num_tokens: int) -> torch.Tensor:
        row = torch.arange(self.length, self.length + num_tokens, device=self.device)
        return row.expand(self.batch, num_tokens)

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if layer in self.kv:
            past_k, past_v = self.kv[layer]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.kv[layer] = (k, v)
        return causal_attention(q, k, v, scale)

    def gdn_recurrent(self, num_tokens: int) -> bool:
        # Hugging Face's rule: one token on top of a state runs the recurrence, anything else the chunked form.
        return num_tokens == 1 and self.length > 0

    def gdn_state(self, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.gdn.get(layer, (None, None))

    def set_gdn_state(self, layer: str, conv_inputs: torch.Tensor, states: torch.Tensor) -> None:
        self.gdn[layer] = (conv_inputs, states[:, -1].to(self.state_dtype))

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens
