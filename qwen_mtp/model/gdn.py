"""Gated DeltaNet mixer (Qwen3.5 `linear_attn`): projections, causal conv, gates, delta rule, gated norm."""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.cache_api import ForwardCache
from qwen_mtp.model.layers import GatedRMSNorm, fuse_linears, project
from qwen_mtp.ops.conv import causal_conv1d
from qwen_mtp.ops.gdn import chunked_gated_delta_rule, gate_values
from qwen_mtp.ops.gdn.chunked import gdn_chunked


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, name: str):
        super().__init__()
        self.name = name  # cache key
        self.key_dim = config.gdn_key_dim
        self.value_dim = config.gdn_value_dim
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        hidden, hv, conv_dim = config.hidden_size, config.linear_num_value_heads, config.gdn_conv_dim
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)  # channels [q | k | v], head-major
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, hv, bias=False)
        self.in_proj_a = nn.Linear(hidden, hv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj: torch.Tensor | None = None  # [qkv; z; b; a] once `fuse_projections` ran

    def fuse_projections(self) -> None:
        """The four input projections as one GEMM (`fuse_linears`); the ops read their strided slices."""
        if self.in_proj is None:
            self.in_proj = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def forward(self, x: torch.Tensor, cache: ForwardCache | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        # raw [B, T, C]: pre-conv [q | k | v]
        raw, z, b, a = project(x, self.in_proj, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        z = z.reshape(batch, length, -1, self.dv)
        weight = self.conv1d.weight.squeeze(1)
        if cache is not None and cache.gdn_recurrent(length):
            # Decode / verify: the cache runs the conv and the recurrence on its state memory.
            q, k, v = self._split(cache.gdn_conv_update(self.name, raw, weight))
            out = cache.gdn_delta_rule(self.name, q, k, v, a, b, self.A_log, self.dt_bias)
        else:
            window, ssm = cache.gdn_state(self.name) if cache is not None else (None, None)
            mixed, conv_inputs = causal_conv1d(raw.transpose(1, 2), weight, window)
            q, k, v = self._split(mixed.transpose(1, 2))
            g, beta = gate_values(a, b, self.A_log, self.dt_bias)
            if torch.is_grad_enabled():  # differentiable (training); the op runs the same math without autograd
                out, final = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=ssm)
            else:
                out, final = gdn_chunked(q, k, v, g, beta, ssm)
            if cache is not None:
                cache.set_gdn_state(self.name, conv_inputs[..., conv_inputs.shape[-1] - weight.shape[1] + 1 :], final)
        out = self.norm(out, z)  # [B, T, Hv, dv]: per head, z read in place
        return self.out_proj(out.reshape(batch, length, self.value_dim))

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, C] conv output -> q, k [B, T, Hk, dk], v [B, T, Hv, dv]."""
        batch, length, _ = mixed.shape
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(batch, length, -1, self.dk),
            k.reshape(batch, length, -1, self.dk),
            v.reshape(batch, length, -1, self.dv),
        )
