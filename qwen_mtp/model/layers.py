"""Small building blocks: (1+w) RMSNorm, gated RMSNorm, SwiGLU MLP, rotary cos/sin, fused projections.

Dtype handling mirrors Hugging Face exactly (norms in fp32 and cast once; cos/sin cast to the activation dtype),
because exactness against it is what the tests check. The norms run as ops (`qwen_mtp.ops.norm`): the HF
computation on CPU, a batch-invariant Triton kernel on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen_mtp.ops import norm as norm_ops
from qwen_mtp.ops.swiglu import swiglu


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `x_hat * (1 + w)`, computed in fp32 and cast once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_ops.rms_norm(x, self.weight, self.eps)


def add_and_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + delta; return norm(s), s`: the residual add fused into the next norm when no gradient is
    needed (inference: one launch instead of two); the same numbers either way."""
    if torch.is_grad_enabled():
        summed = x + delta
        return norm(summed), summed
    return norm_ops.add_rms_norm(x, delta, norm.weight, norm.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: plain weight, normalise then gate with silu(z).

    The weight product happens in the activation dtype, the gate product in fp32 (as in HF).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return norm_ops.gated_rms_norm(x, gate, self.weight, self.eps)


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Store the weights of projections that read the same input in one [sum N, K] tensor and make each
    weight a view of it, so one GEMM launch computes them all (decode: fewer launches per layer). Parameter
    names, values and `state_dict` are unchanged; returns the fused weight."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        size = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[start : start + size], requires_grad=linear.weight.requires_grad)
        start += size
    return fused


def project(x: torch.Tensor, fused: torch.Tensor | None, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """Each linear applied to x: one GEMM over the `fuse_linears` weight, split into views, when it exists
    and no gradient is needed; otherwise the separate (differentiable) projections."""
    if fused is None or torch.is_grad_enabled():
        return tuple(linear(x) for linear in linears)
    return torch.split(F.linear(x, fused), [linear.weight.shape[0] for linear in linears], dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # [2I, H] once `fuse_projections` ran; not a parameter

    def fuse_projections(self) -> None:
        """gate and up as one GEMM (`fuse_linears`), whose output the SwiGLU op reads directly."""
        if self.gate_up is None:
            self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(F.linear(x, self.gate_up)))


class RotaryEmbedding(nn.Module):
    """Partial NeoX-style RoPE on the first `rotary_dim` dims of each head.

    Qwen3.5's M-RoPE reduces to this 1-D RoPE for text-only input (all three position streams are equal).
    `inv_freq` is an fp32 non-persistent buffer: it is never in a checkpoint and must not be rounded to bf16.
    """

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        return 1.0 / (self.theta**exponents)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, rotary_dim] in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
