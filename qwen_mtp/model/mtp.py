"""The MTP (multi-token prediction) head: predicts token i+2 from the target's hidden state at i and token i+1.

    x = fc(cat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])   # embedding FIRST
    x = one full-attention decoder layer (own KV cache, rotary position of i)
    h_mtp = mtp.norm(x);  logits = shared lm_head(h_mtp)

`h_i` is the target's hidden state *after* its final norm; a chained draft step feeds back `h_mtp`.
`DraftLmHead` is what the draft steps score with when it is not the shared lm_head itself: its rows for the N
most frequent tokens (`mtp.draft_vocab`), an FP8 block copy of it or of those rows (`mtp.draft_lm_head: fp8`),
or both.
"""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.model.cache_api import ForwardCache, batch_invariant
from qwen_mtp.model.decoder import DecoderLayer, run_layers
from qwen_mtp.model.layers import RMSNorm
from qwen_mtp.model.linear import Linear
from qwen_mtp.model.plan import LayerSpec
from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.ops.linear import linear, linear_fp8
from qwen_mtp.quant.fp8 import FP8_BLOCK, quantize_fp8_block


class MTPHead(nn.Module):
    def __init__(self, shapes: RankShapes, eps: float, specs: tuple[LayerSpec, ...]):
        super().__init__()
        hidden = shapes.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps)
        self.fc = Linear(2 * hidden, hidden)
        self.layers = nn.ModuleList(DecoderLayer(shapes, eps, spec, f"mtp.layers.{spec.index}") for spec in specs)
        self.norm = RMSNorm(hidden, eps)

    def forward(
        self,
        next_embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: ForwardCache | None = None,
    ) -> torch.Tensor:
        """next_embeds, hidden [B, T, H] -> post-`mtp.norm` hidden [B, T, H]."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x, batch_invariant(cache))
        return run_layers(self.layers, x, rope, cache, self.norm)


class DraftLmHead:
    """The lm_head the MTP head's draft steps score through, made once at load from the target's lm_head [V, H]:
    - `ids` [N] (long, ascending; None: the whole vocabulary): a pruned draft vocabulary (`mtp.draft_vocab`), its
      rows gathered, its choices mapped back to full ids through `ids`;
    - `fp8` (`mtp.draft_lm_head: fp8`): those rows stored as e4m3 with 128x128 block scales (`quantize_fp8_block`;
      an N that is not a multiple of 128 ends in a partial block, which the FP8 op masks: no padded row exists, so
      none can be chosen), multiplied by `qwen_mtp::linear_fp8` batch-invariantly, W8A8 on CUDA when `w8a8` (the
      model's `model.fp8_decode`). It halves the bytes a draft step reads from the lm_head; it is a copy, so it
      costs V x H bytes more (1.27 GB at 27B; N x H with a draft vocabulary).
    The target keeps scoring its whole lm_head as loaded, so only the drafts (their cost and acceptance) change.

    Under tensor parallelism `lm_head_weight` is this rank's vocabulary shard, whose first id is `start`, and `ids`
    the draft vocabulary's ids within it (global ids; possibly none): each rank scores its part, and the greedy
    draft is the best over the ranks (`VocabShard.argmax`)."""

    QUANTIZE_ROWS = 64 * FP8_BLOCK[0]  # rows quantized at a time: bounds the temporaries (fp32 copies) at load

    def __init__(
        self,
        lm_head_weight: torch.Tensor,
        ids: torch.Tensor | None = None,
        fp8: bool = False,
        w8a8: bool = True,
        start: int = 0,
    ):
        weight = lm_head_weight.detach()
        self.ids = self.rows = None
        if ids is not None:
            self.ids = ids.to(device=weight.device, dtype=torch.long).sort().values  # global ids [N]
            self.rows = self.ids - start  # their rows of `lm_head_weight`
            weight = weight.index_select(0, self.rows).contiguous()  # [N, H]
        self.w8a8 = w8a8
        self.scale = None  # fp8: block scales [ceil(N/128), ceil(H/128)]
        if fp8 and weight.shape[0]:
            weight, self.scale = self._quantize(weight)
        self.weight = weight  # [N, H]: the lm_head itself, its rows, or their FP8 copy

    @classmethod
    def _quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize_fp8_block` of `weight`, a slice of whole 128-row blocks at a time (blocks are independent, so
        the result is the same as in one call)."""
        parts = [
            quantize_fp8_block(weight[i : i + cls.QUANTIZE_ROWS]) for i in range(0, weight.shape[0], cls.QUANTIZE_ROWS)
        ]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])

    @property
    def size(self) -> int:
        """The ids it scores (N, or V for the whole vocabulary)."""
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Its weight and block scales: the bytes a draft step reads, and the device memory it adds (a copy)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale) if t is not None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits over its ids [..., N], batch-invariant (the draft path's linear), in hidden's dtype."""
        if self.size == 0:  # tensor parallel: no draft id in this rank's shard
            return hidden.new_empty((*hidden.shape[:-1], 0))
        if self.scale is None:
            return linear(hidden, self.weight, True)
        return linear_fp8(hidden, self.weight, self.scale, True, self.w8a8)

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits [B, N] spread over the whole vocabulary [B, V] (this rank's shard under tensor
        parallelism), -inf elsewhere: what the coupled sampler (or a constrained step's mask) scores, so each draft
        token meets the noise and the mask of its full id."""
        if self.ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.rows, logits)
