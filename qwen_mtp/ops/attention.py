"""Causal GQA attention for a block of new queries over a cached context, in plain PyTorch.

Dispatches to `scaled_dot_product_attention` the way Hugging Face's sdpa path does (no mask for a whole
sequence with `is_causal`, none for a single query, an explicit mask otherwise), so CPU results match it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, T, D] are the last T positions of a context whose keys/values are k, v [B, KV, S, D] (S >= T).

    Query i sits at context position S - T + i and sees keys 0..S-T+i. Returns [B, H, T, D].
    q and k go in contiguous, as Hugging Face hands them over (its rotary's outputs): SDPA chooses its CUDA
    backend by layout, and a different backend rounds differently.
    """
    q, k = q.contiguous(), k.contiguous()
    t, s = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if t == s or t == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=scale, enable_gqa=gqa)
    visible = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
