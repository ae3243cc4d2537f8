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
from qwen_mtp.ops.swiglu import swiglu, swiglu_w8a8

W8A8Input = tuple[torch.Tensor, torch.Tensor]  # rows quantized for a W8A8 product: (e4m3 [M, K], scales [M, K/128])


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


def norm_for(
    norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor | None, consumer: nn.Module | None, decode: bool
) -> tuple[torch.Tensor, torch.Tensor, W8A8Input | None]:
    """(norm(s), s, the W8A8 input of `consumer` or None) with s = x + delta (delta None: s = x): the residual add
    fused into the norm (`add_and_norm`), and, on the decode path (`decode`) when `consumer` (the linear that reads
    the normed rows) quantizes them for W8A8 (`takes_w8a8_input`), that quantization too, all in one launch."""
    if decode and consumer is not None and consumer.takes_w8a8_input(x):
        normed, summed, q, q_scale = norm_ops.norm_w8a8(x, norm.weight, norm.eps, delta=delta)
        return normed, x if delta is None else summed, (q, q_scale)
    if delta is None:
        return norm(x), x, None
    return *add_and_norm(norm, x, delta), None


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

    def quantized(self, x: torch.Tensor, gate: torch.Tensor, invariant: bool = False) -> tuple[torch.Tensor, W8A8Input]:
        """`forward` and its rows quantized for the W8A8 product it feeds, in one launch (`qwen_mtp::norm_w8a8`);
        rows of x are per head, so a head of 128 channels is one quantization group of the product's input."""
        normed, _, q, q_scale = norm_ops.norm_w8a8(x, self.weight, self.eps, gate=gate, invariant=invariant)
        return normed, (q, q_scale)


class MLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))`, gate and up one `MergedLinear` read by the SwiGLU op."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [("gate_proj", intermediate), ("up_proj", intermediate)])
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor, invariant: bool = False, x_w8a8: W8A8Input | None = None) -> torch.Tensor:
        """`x_w8a8`: x quantized for the W8A8 gate_up product (`norm_for`), which marks the decode path: then SwiGLU
        quantizes the down projection's input too, where that product wants it."""
        gate_up = self.gate_up_proj.fused(x, invariant, x_w8a8)
        if x_w8a8 is not None and self.down_proj.takes_w8a8_input(gate_up):
            hidden, q, q_scale = swiglu_w8a8(gate_up, invariant)
            return self.down_proj(hidden, invariant, (q, q_scale))
        return self.down_proj(swiglu(gate_up, invariant), invariant)


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
