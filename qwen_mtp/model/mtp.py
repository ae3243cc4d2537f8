"""The MTP (multi-token prediction) head: predicts token i+2 from the target's hidden state at i and token i+1.

    x = fc(cat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])   # embedding FIRST
    x = one full-attention decoder layer (own KV cache, rotary position of i)
    h_mtp = mtp.norm(x);  logits = shared lm_head(h_mtp)

`h_i` is the target's hidden state *after* its final norm; a chained draft step feeds back `h_mtp`.
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
