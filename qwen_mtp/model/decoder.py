"""One pre-norm decoder layer: `h = x + mixer(norm(x)); out = h + mlp(norm(h))`, mixer = GDN or attention."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.attention import GatedAttention
from qwen_mtp.model.cache_api import ForwardCache
from qwen_mtp.model.gdn import GatedDeltaNet
from qwen_mtp.model.layers import MLP, RMSNorm
from qwen_mtp.model.plan import LayerSpec


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, name: str):
        super().__init__()
        self.mixer = spec.mixer
        # Attribute names are the checkpoint's: `linear_attn` for GDN layers, `self_attn` for attention.
        if spec.mixer == "gdn":
            self.linear_attn = GatedDeltaNet(config, name)
        else:
            self.self_attn = GatedAttention(config, name)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: ForwardCache | None = None
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if self.mixer == "gdn":
            x = x + self.linear_attn(normed, cache)
        else:
            x = x + self.self_attn(normed, rope, cache)
        return x + self.mlp(self.post_attention_layernorm(x))
