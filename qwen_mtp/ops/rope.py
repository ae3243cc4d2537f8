"""Partial rotary embedding, and the attention layer's q/k head norms + rotary as one op.

Why an op: in plain torch a decode step spends ~20 small launches per attention layer on the per-head norms
(each on a strided slice of the projection: a copy first), the rotate-half concatenations and the four
bf16 products and sums. The Triton kernel does q and k of every token in one launch, reading the strided
slices of the fused projection directly. It rounds where the torch composition rounds (the norm's result,
then each bf16 product and the sum), so it computes the same numbers, and each (token, head) is one program:
nothing depends on the batch. FMA contraction is off for this kernel: with it, the compiler fused
`y * cos + rotated * sin` into one FMA even across the explicit bf16 casts (H200: 58% of the tiny model's
logits stayed within 2 bf16 ulps of Hugging Face's, against 100% for the torch composition).
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.norm import rms_norm_reference


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE on x[..., :rd] (rd = cos.shape[-1]); the rest passes through. cos and sin
    broadcast against x[..., :rd] and share its dtype, so the products and the sum round as HF's do."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D], k [B, T, KV, D] (any strides); cos, sin [B, T, rd] -> rotate(rms_norm(q)), the same
    for k, each [B, T, heads, D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (
        rotate(rms_norm_reference(q, q_weight, eps), cos, sin),
        rotate(rms_norm_reference(k, k_weight, eps), cos, sin),
    )


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _qk_norm_rope_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "sq_b", "sq_t", "sk_b", "sk_t"])
    def qk_norm_rope_rows(
        q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
        T, H, KV, eps,
        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sc_r,
        D: tl.constexpr, RD: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one token, one head (q heads first, then k heads). The rotate-half partner of each
        # element is normalised a second time from a permuted load: the same operations on the same inputs,
        # so the same bits as indexing the normalised row.
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)
        b = row // T
        t = row % T
        if head < H:
            src = q_ptr + b * sq_b + t * sq_t + head * sq_h
            w_ptr = qw_ptr
            dst = qo_ptr + (row * H + head) * D
        else:
            src = k_ptr + b * sk_b + t * sk_t + (head - H) * sk_h
            w_ptr = kw_ptr
            dst = ko_ptr + (row * KV + head - H) * D
        ds = tl.arange(0, D)
        half: tl.constexpr = RD // 2
        partner = tl.where(ds < half, ds + half, tl.where(ds < RD, ds - half, ds))
        x = tl.load(src + ds).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = (x * inv * (1.0 + tl.load(w_ptr + ds).to(tl.float32))).to(qo_ptr.dtype.element_ty)
        xp = tl.load(src + partner).to(tl.float32)
        yp = (xp * inv * (1.0 + tl.load(w_ptr + partner).to(tl.float32))).to(qo_ptr.dtype.element_ty)
        rotated = tl.where(ds < half, -yp.to(tl.float32), yp.to(tl.float32))
        in_rope = ds < RD
        c = tl.load(cos_ptr + row * sc_r + ds, mask=in_rope, other=0.0)
        s = tl.load(sin_ptr + row * sc_r + ds, mask=in_rope, other=0.0)
        dtype = qo_ptr.dtype.element_ty
        first = (y.to(tl.float32) * c.to(tl.float32)).to(dtype).to(tl.float32)
        second = (rotated * s.to(tl.float32)).to(dtype).to(tl.float32)
        out = tl.where(in_rope, (first + second).to(dtype), y)
        tl.store(dst + ds, out)

    return qk_norm_rope_rows


def qk_norm_rope_triton(q, k, q_weight, k_weight, eps, cos, sin):
    """Triton version of `qk_norm_rope_reference` (same arguments; outputs contiguous)."""
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[2]
    assert q.stride(3) == 1 and k.stride(3) == 1 and cos.shape == sin.shape
    cos, sin = cos.reshape(-1, cos.shape[-1]).contiguous(), sin.reshape(-1, sin.shape[-1]).contiguous()
    q_out = q.new_empty(q.shape)
    k_out = k.new_empty(k.shape)
    _qk_norm_rope_kernel()[(batch * length, heads + kv_heads)](
        q, k, q_weight, k_weight, cos, sin, q_out, k_out,
        length, heads, kv_heads, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0),
        D=dim, RD=cos.shape[-1],
        **triton_utils.launch(q.device, fp_fusion=False),  # no FMA: torch rounds the products before the sum
    )  # fmt: skip
    return q_out, k_out


@torch.library.custom_op("qwen_mtp::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: `qk_norm_rope_reference` on CPU, one Triton launch on CUDA."""
    q_out, k_out = qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos, sin)
    return q_out.contiguous(), k_out.contiguous()


@cuda_kernel(qk_norm_rope)
def _(q, k, q_weight, k_weight, eps, cos, sin):
    if reference_forced("qk_norm_rope"):
        q_out, k_out = qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos, sin)
        return q_out.contiguous(), k_out.contiguous()
    return qk_norm_rope_triton(q, k, q_weight, k_weight, eps, cos, sin)


@qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, eps, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)  # contiguous, as both implementations return


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)

register_reference_autograd(qk_norm_rope, qk_norm_rope_reference)
