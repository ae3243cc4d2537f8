"""Gated full attention (Qwen3.5 `self_attn`): q + output gate from one projection, per-head q/k norms,
partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.cache_api import ForwardCache
from qwen_mtp.model.layers import RMSNorm, fuse_linears, project
from qwen_mtp.ops.attention import causal_attention
from qwen_mtp.ops.rope import qk_norm_rope, rotate


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
        self.qkv: torch.Tensor | None = None  # [q_proj; k_proj; v_proj] once `fuse_projections` ran

    def fuse_projections(self) -> None:
        """q (+ gate), k and v as one GEMM (`fuse_linears`)."""
        if self.qkv is None:
            self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: ForwardCache | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q_gate, k, v = project(x, self.qkv, self.q_proj, self.k_proj, self.v_proj)
        q_gate = q_gate.view(batch, length, self.heads, 2 * self.head_dim)
        k = k.view(batch, length, self.kv_heads, self.head_dim)
        v = v.view(batch, length, self.kv_heads, self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]  # [B, T, H, D] views
        cos, sin = rope
        if torch.is_grad_enabled():  # differentiable composition (training)
            q = rotate(self.q_norm(q), cos.unsqueeze(2), sin.unsqueeze(2))
            k = rotate(self.k_norm(k), cos.unsqueeze(2), sin.unsqueeze(2))
        else:  # the same numbers in one launch on CUDA
            q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if cache is None:
            out = causal_attention(q, k, v, self.scale)
        else:
            out = cache.attend(self.name, q, k, v, self.scale)
        out = out.transpose(1, 2) * torch.sigmoid(gate)  # [B, T, H, D]
        return self.o_proj(out.reshape(batch, length, -1))
