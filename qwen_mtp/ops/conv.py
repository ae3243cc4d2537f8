"""Causal depthwise conv1d + SiLU over the GDN `[q|k|v]` channels, with a carried window of past inputs.

The window holds the last `kernel - 1` raw (pre-conv) inputs of a sequence, so a continuation computes exactly
what one pass over the whole sequence computes: zeros stand before position 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C, T], weight [C, K], window [B, C, K-1] or None (= zeros).

    Returns (silu(conv) [B, C, T] in x's dtype, the conv's whole input [B, C, K-1+T]: window then x, from
    which a cache keeps what it needs). Computed in the weight's dtype, as Hugging Face does.
    """
    channels, kernel = weight.shape
    length = x.shape[-1]
    out_dtype, x = x.dtype, x.to(weight.dtype)
    if window is None:
        # Zero left-padding inside conv1d, exactly as Hugging Face's prefill path computes it.
        out = F.conv1d(x, weight.unsqueeze(1), padding=kernel - 1, groups=channels)[..., :length]
        full = F.pad(x, (kernel - 1, 0))
    else:
        full = torch.cat([window.to(weight.dtype), x], dim=-1)
        out = F.conv1d(full, weight.unsqueeze(1), groups=channels)[..., -length:]
    return F.silu(out).to(out_dtype), full
