"""Gated DeltaNet mixer (Qwen3.5 `linear_attn`): projections, causal conv, gates, delta rule, gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.cache_api import ForwardCache
from qwen_mtp.model.layers import GatedRMSNorm
from qwen_mtp.ops.conv import causal_conv1d
from qwen_mtp.ops.gdn import chunked_gated_delta_rule, recurrent_gated_delta_rule


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

    def forward(self, x: torch.Tensor, cache: ForwardCache | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        window, ssm = cache.gdn_state(self.name) if cache is not None else (None, None)
        kernel = self.conv1d.weight.shape[-1]
        mixed, conv_inputs = causal_conv1d(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight.squeeze(1), window)
        q, k, v = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, length, -1, self.dk)
        k = k.reshape(batch, length, -1, self.dk)
        v = v.reshape(batch, length, -1, self.dv)
        z = self.in_proj_z(x).reshape(batch, length, -1, self.dv)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if cache is not None and cache.gdn_recurrent(length):
            # Decode / verify: token by token, keeping the state after every token for speculative commit.
            out, states = recurrent_gated_delta_rule(q, k, v, g, beta, ssm, state_dtype=cache.state_dtype)
            cache.set_gdn_state(self.name, conv_inputs[..., 1:], states)
        else:
            out, final = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=ssm)
            if cache is not None:
                cache.set_gdn_state(self.name, conv_inputs[..., conv_inputs.shape[-1] - (kernel - 1) :], final[:, None])
        out = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(out.reshape(batch, length, self.value_dim))
