"""The MTP (multi-token prediction) head: predicts token i+2 from the target's hidden state at i and token i+1.

    x = fc(cat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])   # embedding FIRST
    x = one full-attention decoder layer (own KV cache, rotary position of i)
    h_mtp = mtp.norm(x);  logits = shared lm_head(h_mtp)

`h_i` is the target's hidden state *after* its final norm; a chained draft step feeds back `h_mtp`.
`DraftVocab` (`mtp.draft_vocab`) replaces the shared lm_head by its rows for the N most frequent tokens.
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
from qwen_mtp.ops.linear import linear


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


class DraftVocab:
    """A pruned draft vocabulary: the MTP head scores only `ids` [N] (long, ascending) through `weight` [N, H],
    the lm_head rows of those ids gathered once. Its choices map back to full ids through `ids`; the target
    still scores the whole vocabulary, so only the drafts (their cost and acceptance) change."""

    def __init__(self, lm_head_weight: torch.Tensor, ids: torch.Tensor):
        self.ids = ids.to(device=lm_head_weight.device, dtype=torch.long).sort().values
        self.weight = lm_head_weight.detach().index_select(0, self.ids).contiguous()  # [N, H]

    @property
    def size(self) -> int:
        return self.ids.numel()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits over the draft vocabulary [..., N], batch-invariant (the draft path's linear)."""
        return linear(hidden, self.weight, True)

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits [B, N] spread over the whole vocabulary [B, V], -inf elsewhere: what the
        coupled sampler scores, so each draft token meets the noise of its full id."""
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, logits)
