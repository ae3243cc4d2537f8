"""FP8 e4m3 weights with block scales, in the Qwen / DeepSeek checkpoint format.

`weight` is float8_e4m3fn [N, K]; `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] is a *multiplier* despite its
name: W[r, c] = fp8[r, c] * scale_inv[r // bn, c // bk]. Edge blocks may be partial.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = block
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [N, K] and its block scales -> fp32 [N, K]."""
    return weight.float() * _expand(scale_inv.float(), weight.shape, block)


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] in `scale_dtype`): each block's amax maps to
    448. The scale is rounded to `scale_dtype` before dividing, so dequantizing reproduces the stored values."""
    rows, cols = block
    n, k = weight.shape
    w = weight.float()
    padded = torch.nn.functional.pad(w.abs(), (0, -k % cols, 0, -n % rows))
    amax = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    q = (w / _expand(scale.float(), w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
