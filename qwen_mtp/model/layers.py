"""Small building blocks: (1+w) RMSNorm, gated RMSNorm, SwiGLU MLP, rotary cos/sin.

Dtype handling mirrors Hugging Face exactly (norms in fp32 and cast once; cos/sin cast to the activation dtype),
because exactness against it is what the tests check. The norms run as ops (`qwen_mtp.ops.norm`): the HF
computation on CPU, a batch-invariant Triton kernel on CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.model.linear import Linear, MergedLinear
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
    """`s = x + delta; return norm(s), s`: the residual add fused into the next norm (one launch instead of
    two on CUDA), rounded as the separate add and norm are."""
    return norm_ops.add_rms_norm(x, delta, norm.weight, norm.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: plain weight, normalise then gate with silu(z).

    The weight product happens in the activation dtype, the gate product in fp32 (as in HF).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        return norm_ops.gated_rms_norm(x, gate, self.weight, self.eps, invariant)


class MLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))`, gate and up one `MergedLinear` read by the SwiGLU op."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [("gate_proj", intermediate), ("up_proj", intermediate)])
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj.fused(x, invariant), invariant), invariant)


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
