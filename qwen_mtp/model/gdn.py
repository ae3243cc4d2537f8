"""Gated DeltaNet mixer (Qwen3.5 `linear_attn`): projections, causal conv, gates, delta rule, gated norm."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.model.cache_api import ForwardCache, batch_invariant, decode_rows, packed_gdn_states, sequences
from qwen_mtp.model.layers import GatedRMSNorm, W8A8Input
from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.ops.conv import conv_prefill, conv_prefill_varlen
from qwen_mtp.ops.gdn import gate_values, gate_values_varlen
from qwen_mtp.ops.gdn.chunked import gdn_chunked, gdn_chunked_varlen


class GatedDeltaNet(nn.Module):
    def __init__(self, shapes: RankShapes, eps: float, name: str):
        super().__init__()
        self.name = name  # cache key
        self.key_dim = shapes.gdn_key_dim
        self.value_dim = shapes.gdn_value_dim
        self.dk = shapes.gdn_key_head_dim
        self.dv = shapes.gdn_value_head_dim
        hidden, hv, conv_dim = shapes.hidden_size, shapes.gdn_value_heads, shapes.gdn_conv_dim
        self.in_proj = MergedLinear(
            hidden,
            [  # in_proj_qkv channels: [q | k | v], head-major
                ("in_proj_qkv", conv_dim),
                ("in_proj_z", self.value_dim),
                ("in_proj_b", hv),
                ("in_proj_a", hv),
            ],
        )
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, shapes.conv_kernel, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.norm = GatedRMSNorm(self.dv, eps)
        self.out_proj = Linear(self.value_dim, hidden)

    def forward(
        self, x: torch.Tensor, cache: ForwardCache | None = None, x_w8a8: W8A8Input | None = None
    ) -> torch.Tensor:
        """`x_w8a8`: x quantized for the W8A8 input projection (`layers.norm_for`)."""
        batch, length, _ = x.shape
        invariant = batch_invariant(cache)
        raw, z, b, a = self.in_proj(x, invariant, x_w8a8)  # raw [B, T, C]: pre-conv [q | k | v]
        z = z.reshape(batch, length, -1, self.dv)
        weight = self.conv1d.weight.squeeze(1)
        if cache is not None and cache.gdn_recurrent(length):
            # Decode / verify: the cache runs the conv and the recurrence on its state memory.
            q, k, v = self._split(cache.gdn_conv_update(self.name, raw, weight))
            out = cache.gdn_delta_rule(self.name, q, k, v, a, b, self.A_log, self.dt_bias)
        elif len(entries := sequences(cache)) == 1:
            out = self._chunked(raw, a, b, weight, entries[0][1])  # prefill of whole sequences ([B, T] rows)
        else:
            out = self._packed(raw, a, b, weight, cache)  # prefill of a packed step: several chunks end to end
        if decode_rows(cache) and self.dv % 128 == 0 and self.out_proj.takes_w8a8_input(out):
            out, out_w8a8 = self.norm.quantized(out, z, invariant)  # the norm quantizes out_proj's input
            return self.out_proj(out.reshape(batch, length, self.value_dim), invariant, out_w8a8)
        out = self.norm(out, z, invariant)  # [B, T, Hv, dv]: per head, z read in place
        return self.out_proj(out.reshape(batch, length, self.value_dim), invariant)

    def _chunked(self, raw, a, b, weight, cache: ForwardCache | None) -> torch.Tensor:
        """The chunked path over whole sequences continuing their cached state: [B, T, Hv, dv]."""
        window, ssm = cache.gdn_state(self.name) if cache is not None else (None, None)
        mixed, next_window = conv_prefill(raw, weight, window)
        q, k, v = self._split(mixed)
        g, beta = gate_values(a, b, self.A_log, self.dt_bias)
        out, final = gdn_chunked(q, k, v, g, beta, ssm)
        if cache is not None:
            cache.set_gdn_state(self.name, next_window, final)
        return out

    def _packed(self, raw, a, b, weight, cache: ForwardCache) -> torch.Tensor:
        """The chunked path over a packed step ([1, N]: S sequences end to end), each continuing its own cached
        state: [1, N, Hv, dv]. The conv, the gates and the delta rule each run once over all S, each sequence's
        numbers bitwise those of `_chunked` on it alone (`conv_prefill_varlen`, `gate_values_varlen`,
        `gdn_chunked_varlen`: on CPU the first two run per sequence, where an elementwise op's rounding depends on
        its tensor's size)."""
        cu_seqlens, windows, ssm = packed_gdn_states(cache, self.name)
        mixed, next_windows = conv_prefill_varlen(raw, weight, cu_seqlens, windows)
        q, k, v = self._split(mixed)
        g, beta = gate_values_varlen(a, b, self.A_log, self.dt_bias, cu_seqlens)
        out, finals = gdn_chunked_varlen(q, k, v, g, beta, cu_seqlens, ssm)
        cache.set_gdn_state(self.name, next_windows, finals)  # every sequence's row at once
        return out

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, C] conv output -> q, k [B, T, Hk, dk], v [B, T, Hv, dv]."""
        batch, length, _ = mixed.shape
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(batch, length, -1, self.dk),
            k.reshape(batch, length, -1, self.dk),
            v.reshape(batch, length, -1, self.dv),
        )
