"""Gated full attention (Qwen3.5 `self_attn`): q + output gate from one projection, per-head q/k norms,
partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.model.cache_api import ForwardCache, batch_invariant, decode_rows
from qwen_mtp.model.layers import RMSNorm, W8A8Input
from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.ops.attention import causal_attention
from qwen_mtp.ops.output_gate import output_gate, output_gate_w8a8
from qwen_mtp.ops.rope import qk_norm_rope


class GatedAttention(nn.Module):
    def __init__(self, shapes: RankShapes, eps: float, name: str):
        super().__init__()
        self.name = name  # cache key
        self.heads, self.kv_heads, self.head_dim = shapes.heads, shapes.kv_heads, shapes.head_dim
        self.scale = self.head_dim**-0.5
        hidden = shapes.hidden_size
        # q_proj rows are interleaved per head: [q_h0 | gate_h0 | q_h1 | gate_h1 | ...], each head_dim wide.
        q_rows, kv_rows = 2 * self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)])
        self.o_proj = Linear(self.heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: ForwardCache | None = None,
        x_w8a8: W8A8Input | None = None,
    ) -> torch.Tensor:
        """`x_w8a8`: x quantized for the W8A8 qkv projection (`layers.norm_for`)."""
        batch, length, _ = x.shape
        invariant = batch_invariant(cache)
        q_gate, k, v = self.qkv_proj(x, invariant, x_w8a8)
        q_gate = q_gate.view(batch, length, self.heads, 2 * self.head_dim)
        k = k.view(batch, length, self.kv_heads, self.head_dim)
        v = v.view(batch, length, self.kv_heads, self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]  # [B, T, H, D] views
        cos, sin = rope
        q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if cache is None:
            out = causal_attention(q, k, v, self.scale)
        else:
            out = cache.attend(self.name, q, k, v, self.scale)
        out = out.transpose(1, 2)  # [B, T, H, D]: the output gate reads it in place
        if decode_rows(cache) and self.head_dim % 128 == 0 and self.o_proj.takes_w8a8_input(out):
            gated, q, q_scale = output_gate_w8a8(out, gate, invariant)  # and quantizes o_proj's input
            return self.o_proj(gated, invariant, (q, q_scale))
        return self.o_proj(output_gate(out, gate, invariant), invariant)
