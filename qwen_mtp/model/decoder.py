"""One pre-norm decoder layer: `h = x + mixer(norm(x)); out = h + mlp(norm(h))`, mixer = GDN or attention.

The residual adds are fused into the following norm (`add_and_norm`): a layer returns `(h, mlp_out)` and
leaves `h + mlp_out` to the next layer's input norm (or the stack's final norm), which adds it in the same
launch. `run_layers` walks a stack that way."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.model.attention import GatedAttention
from qwen_mtp.model.cache_api import ForwardCache, batch_invariant, decode_rows
from qwen_mtp.model.gdn import GatedDeltaNet
from qwen_mtp.model.layers import MLP, RMSNorm, add_and_norm, norm_for
from qwen_mtp.model.moe import SparseMoeBlock
from qwen_mtp.model.plan import LayerSpec
from qwen_mtp.model.shapes import RankShapes


class DecoderLayer(nn.Module):
    def __init__(self, shapes: RankShapes, eps: float, spec: LayerSpec, name: str):
        super().__init__()
        self.mixer = spec.mixer
        # Attribute names are the checkpoint's: `linear_attn` for GDN layers, `self_attn` for attention.
        if spec.mixer == "gdn":
            self.linear_attn = GatedDeltaNet(shapes, eps, name)
        else:
            self.self_attn = GatedAttention(shapes, eps, name)
        if spec.moe is None:
            self.mlp = MLP(shapes.hidden_size, shapes.intermediate_size)
        else:
            experts, shared = shapes.expert_intermediate_size, shapes.shared_expert_intermediate_size
            self.mlp = SparseMoeBlock(shapes.hidden_size, spec.moe, experts, shared)
        self.input_layernorm = RMSNorm(shapes.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(shapes.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: ForwardCache | None = None,
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input `x + pending` (pending: the previous layer's MLP output, None for the first layer); returns
        (h, mlp_out) with the layer's output = h + mlp_out. On the decode path each norm also quantizes its output
        where the projection it feeds runs W8A8 (`norm_for`)."""
        decode = decode_rows(cache)
        mixer = self.linear_attn.in_proj if self.mixer == "gdn" else self.self_attn.qkv_proj
        normed, x, x_w8a8 = norm_for(self.input_layernorm, x, pending, mixer, decode)
        if self.mixer == "gdn":
            mixed = self.linear_attn(normed, cache, x_w8a8)
        else:
            mixed = self.self_attn(normed, rope, cache, x_w8a8)
        mlp = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else None
        normed, x, x_w8a8 = norm_for(self.post_attention_layernorm, x, mixed, mlp, decode)
        if x_w8a8 is None:
            return x, self.mlp(normed, batch_invariant(cache))
        return x, self.mlp(normed, batch_invariant(cache), x_w8a8)


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: ForwardCache | None,
    final_norm: RMSNorm,
) -> torch.Tensor:
    """final_norm(output of the stack), the last residual add fused into the norm."""
    pending = None
    for layer in layers:
        x, pending = layer(x, rope, cache, pending)
    return final_norm(x) if pending is None else add_and_norm(final_norm, x, pending)[0]
