"""Gated full attention (Qwen3.5 `self_attn`): q + output gate from one projection, per-head q/k norms,
partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.cache_api import ForwardCache
from qwen_mtp.model.layers import RMSNorm, apply_rotary
from qwen_mtp.ops.attention import causal_attention


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, name: str):
        super().__init__()
        self.name = name  # cache key
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        # q_proj rows are interleaved per head: [q_h0 | gate_h0 | q_h1 | gate_h1 | ...], each head_dim wide.
        self.q_proj = nn.Linear(hidden, 2 * self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: ForwardCache | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, gate = torch.chunk(self.q_proj(x).view(batch, length, self.heads, 2 * self.head_dim), 2, dim=-1)
        gate = gate.reshape(batch, length, -1)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            out = causal_attention(q, k, v, self.scale)
        else:
            out = cache.attend(self.name, q, k, v, self.scale)
        out = out.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate)
        return self.o_proj(out)
