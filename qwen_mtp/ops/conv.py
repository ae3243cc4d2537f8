"""Causal depthwise conv1d + SiLU over the GDN `[q|k|v]` channels, with a carried window of past inputs.

The window holds the last `kernel - 1` raw (pre-conv) inputs of a sequence, so a continuation computes exactly
what one pass over the whole sequence computes: zeros stand before position 0.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from qwen_mtp.ops import elementwise, triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C, T], weight [C, K], window [B, C, K-1] or None (= zeros).

    Returns (silu(conv) [B, C, T] in x's dtype, the conv's whole input [B, C, K-1+T]: window then x, from
    which a cache keeps what it needs). Computed in the weight's dtype, as Hugging Face does. `invariant`
    (decode, verify): the silu of a (request, token) rounds the same whatever B and T (`ops/elementwise.py`).
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
    return elementwise.silu(out, invariant).to(out_dtype), full


# ---- prefill: the conv over whole chunks, token-major, as one kernel ----


def conv_prefill_reference(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C] raw inputs (token-major: the input projection's qkv slice), weight [C, K], window [B, C, K-1]
    or None (zeros). Returns (silu(conv) [B, T, C] contiguous, in x's dtype; the next window [B, C, K-1]: the
    last K-1 inputs of window then x, in the weight's dtype). `causal_conv1d` on the transposed input."""
    out, full = causal_conv1d(x.transpose(1, 2), weight, window)
    return out.transpose(1, 2).contiguous(), full[..., full.shape[-1] - weight.shape[1] + 1 :].contiguous()


def next_window(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
    """The last K-1 inputs of (window, x) as [B, C, K-1] in the weight's dtype: exactly the reference's values
    (inputs cast to the weight's dtype), read from x directly once it holds K-1 tokens."""
    keep = weight.shape[1] - 1
    tail = x[:, max(0, x.shape[1] - keep) :].transpose(1, 2).to(weight.dtype)
    if tail.shape[-1] < keep:
        before = window.to(weight.dtype) if window is not None else tail.new_zeros(*tail.shape[:2], keep)
        tail = torch.cat([before, tail], dim=-1)[..., -keep:]
    return tail.clone(memory_format=torch.contiguous_format)  # never a view of x (a custom op's outputs)


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _conv_prefill_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["N", "S"])
    def conv_prefill(
        x_ptr, w_ptr, cu_ptr, window_ptr, out_ptr, N, S, C, s_xt, s_ot,
        KERNEL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: BLOCK_T of the N packed tokens x BLOCK_C channels. A token's sequence (and its first token)
        # comes from cu_seqlens; tap j of token t reads input t - K+1 + j from x, or before its sequence's first
        # token from that sequence's window (zeros without one). Each output's arithmetic is the same whatever
        # the packing, the chunking or N: taps in order, fp32, rounded to the weight's dtype as the conv's output.
        triton_utils.wait_for_previous_kernel(PDL)
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cs < C
        seq = ts * 0
        start = ts * 0 + tl.load(cu_ptr)
        for s in range(1, S):  # a token at or past sequence s's first token belongs to it or a later one
            bound = tl.load(cu_ptr + s)
            later = ts >= bound
            seq = tl.where(later, s, seq)
            start = tl.where(later, bound, start)
        w_type = w_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(KERNEL):
            w = tl.load(w_ptr + cs * KERNEL + j, mask=cmask, other=0.0).to(tl.float32)
            p = ts - (KERNEL - 1) + j
            inside = ((p >= start) & (ts < N))[:, None] & cmask[None, :]
            x = tl.load(x_ptr + p.to(tl.int64)[:, None] * s_xt + cs[None, :], mask=inside, other=0.0)
            tap = x.to(w_type).to(tl.float32)
            if HAS_WINDOW:
                before = ((p < start) & (ts < N))[:, None] & cmask[None, :]
                tap_in_window = p - start + KERNEL - 1
                offsets = (seq.to(tl.int64)[:, None] * C + cs[None, :]) * (KERNEL - 1) + tap_in_window[:, None]
                tap += tl.load(window_ptr + offsets, mask=before, other=0.0).to(w_type).to(tl.float32)
            acc += w[None, :] * tap
        conv = acc.to(w_type).to(tl.float32)
        out = (conv * tl.sigmoid(conv)).to(w_type)
        keep = (ts < N)[:, None] & cmask[None, :]
        tl.store(out_ptr + ts.to(tl.int64)[:, None] * s_ot + cs[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)

    return conv_prefill


CONV_BLOCK_T, CONV_BLOCK_C, CONV_WARPS = 32, 128, 4


def _launch(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, windows: torch.Tensor | None):
    """The kernel over x [N, C] (channels contiguous; S sequences packed back to back, bounds cu_seqlens [S + 1]
    on the device), windows [S, C, K-1] or None: silu(conv) [N, C] in x's dtype."""
    import triton

    length, channels = x.shape
    out = torch.empty(length, channels, dtype=x.dtype, device=x.device)
    window_arg = windows.contiguous() if windows is not None else out  # (not read without windows)
    grid = (triton.cdiv(length, CONV_BLOCK_T), triton.cdiv(channels, CONV_BLOCK_C))
    _conv_prefill_kernel()[grid](
        x, weight.contiguous(), cu_seqlens, window_arg, out, length, cu_seqlens.shape[0] - 1, channels, x.stride(0),
        out.stride(0), KERNEL=weight.shape[1], HAS_WINDOW=windows is not None, BLOCK_T=CONV_BLOCK_T,
        BLOCK_C=CONV_BLOCK_C, num_warps=CONV_WARPS, **triton_utils.launch(x.device),
    )  # fmt: skip
    return out


def conv_prefill_triton(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `conv_prefill_reference`: the B sequences as B packed ones (the kernel
    `conv_prefill_varlen_triton` runs), x read in place when its rows can be flattened (the input projection's
    strided qkv slice can), the token-major output written once: no transposes, no window concatenated."""
    batch, length, channels = x.shape
    x = x if x.stride(2) == 1 else x.contiguous()
    flat = batch == 1 or x.stride(0) == length * x.stride(1)
    rows = x.view(batch * length, channels) if flat else x.reshape(batch * length, channels)
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=x.device)
    out = _launch(rows, weight, cu, window)
    return out.view(batch, length, channels), next_window(x, weight, window)


def conv_prefill_varlen_reference(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, windows: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, N, C]: S sequences packed back to back (bounds cu_seqlens [S + 1]), windows: each one's [1, C, K-1]
    or None. `conv_prefill_reference` on each: (silu(conv) [1, N, C], next windows [S, C, K-1])."""
    bounds = cu_seqlens.tolist()
    parts = [
        conv_prefill_reference(x[:, first:end], weight, window)
        for first, end, window in zip(bounds[:-1], bounds[1:], windows, strict=True)
    ]
    return torch.cat([out for out, _ in parts], dim=1), torch.cat([nxt for _, nxt in parts])


def conv_prefill_varlen_triton(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, windows: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `conv_prefill_varlen_reference`: one launch for all S sequences, each token's output
    bitwise what `conv_prefill_triton` gives its sequence alone; reads nothing back to the host. A missing window
    is zeros (the kernel's arithmetic is then the same as without one)."""
    x = x if x.stride(2) == 1 else x.contiguous()
    keep = weight.shape[1] - 1
    stacked = None
    if any(w is not None for w in windows):
        zeros = x.new_zeros(1, x.shape[2], keep, dtype=weight.dtype)
        stacked = torch.cat([w if w is not None else zeros for w in windows])
    cu = cu_seqlens.to(torch.int32)
    out = _launch(x[0], weight, cu, stacked)
    # each sequence's last K-1 inputs: from x, or (a sequence shorter than K-1) from its window
    positions = cu[1:, None].long() - keep + torch.arange(keep, device=x.device)  # [S, K-1]
    starts = cu[:-1, None].long()
    from_x = x[0, positions.clamp(min=0)].transpose(1, 2).to(weight.dtype)  # [S, C, K-1]
    if stacked is None:
        from_window = torch.zeros_like(from_x)
    else:
        index = (positions - starts + keep).clamp(0, keep - 1)[:, None, :].expand(-1, x.shape[2], -1)
        from_window = torch.gather(stacked.to(weight.dtype), 2, index)
    return out[None], torch.where((positions >= starts)[:, None, :], from_x, from_window).contiguous()


@torch.library.custom_op("qwen_mtp::conv_prefill", mutates_args=())
def conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: `conv_prefill_reference` on CPU (Hugging Face's conv, bit for bit), the Triton kernel on CUDA
    (each token's output the same whatever the chunking and the batch)."""
    return conv_prefill_reference(x, weight, window)


@cuda_kernel(conv_prefill)
def _(x, weight, window):
    if reference_forced("conv_prefill"):
        return conv_prefill_reference(x, weight, window)
    return conv_prefill_triton(x, weight, window)


@conv_prefill.register_fake
def _(x, weight, window):
    batch, _, channels = x.shape
    return x.new_empty(x.shape), weight.new_empty(batch, channels, weight.shape[1] - 1)


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)

register_reference_autograd(conv_prefill, conv_prefill_reference)


@torch.library.custom_op("qwen_mtp::conv_prefill_varlen", mutates_args=())
def conv_prefill_varlen(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, windows: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: `conv_prefill_varlen_reference` on CPU (each sequence as `conv_prefill` alone), one Triton
    launch over all the packed sequences on CUDA (each bitwise as `conv_prefill` alone)."""
    return conv_prefill_varlen_reference(x, weight, cu_seqlens, list(windows))


@cuda_kernel(conv_prefill_varlen)
def _(x, weight, cu_seqlens, windows):
    if reference_forced("conv_prefill_varlen"):
        return conv_prefill_varlen_reference(x, weight, cu_seqlens, list(windows))
    return conv_prefill_varlen_triton(x, weight, cu_seqlens, list(windows))


@conv_prefill_varlen.register_fake
def _(x, weight, cu_seqlens, windows):
    return x.new_empty(x.shape), weight.new_empty(cu_seqlens.shape[0] - 1, x.shape[2], weight.shape[1] - 1)


# ---- decode / verify: the conv over T = 1..K+1 new tokens, reading and writing a request's pooled window ----


def conv_update_reference(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor
) -> torch.Tensor:
    """x [B, T, C] new raw inputs; weight [C, K]; pool [rows, C, W] conv windows (W >= K-2+T); rows [B];
    committed [rows]: where each row's window starts.

    Reads the window `pool[row, :, c : c+K-1]` (c = committed[row]), returns silu(conv) [B, T, C], and writes
    the step's inputs after the window's first, `cat(window, x)[1:]`, to `pool[row, :, :K-2+T]`, so that after
    accepting j drafts the next window starts at offset j.
    """
    kernel = weight.shape[1]
    start = committed[rows]
    index = (start[:, None] + torch.arange(kernel - 1, device=x.device))[:, None, :]
    windows = torch.gather(pool[rows], 2, index.expand(-1, pool.shape[1], -1))
    out, full = causal_conv1d(x.transpose(1, 2), weight, windows, invariant=True)
    pool[rows, :, : full.shape[-1] - 1] = full[..., 1:].to(pool.dtype)
    return out.transpose(1, 2)


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _conv_update_kernel():
    import triton
    import triton.language as tl

    # One binary for every T and every pool width (MAX_T is a constant, T and W runtime values): plain decode,
    # MTP verify and engines with different K must all run the very same code. The token loop is unrolled to MAX_T
    # (each token's taps are then fixed columns of the tile) and token t's body runs only when t < T, so a plain
    # step does not pay for the tokens a verify may bring; a token's code is the same whatever T is.
    @triton.jit(do_not_specialize=["T", "W", "stride_xb", "stride_xt", "stride_ob", "stride_pr"])
    def conv_update_window(
        x_ptr, w_ptr, pool_ptr, rows_ptr, committed_ptr, out_ptr,
        T, C, W,
        stride_xb, stride_xt, stride_ob, stride_ot, stride_pr, stride_pc,
        KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, MAX_T: tl.constexpr, FULL: tl.constexpr, TAPS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one request, BLOCK_C channels, all T tokens. The weights never change during a step, and
        # no kernel that may still run writes the window (`triton_utils.launch`), so both load before the wait for
        # the previous kernel; the new tokens after it. (Wider programs, 256 to 2048 channels, were slower
        # on the H200 at every B and T: docs/img/small-kernels-fifteenth.json.) The whole conv input (window +
        # new tokens) is loaded as one [BLOCK_C, FULL] tile before the barrier; the pool is written after it, so
        # the window read at offset `committed` survives its overwrite at offset 0.
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cs < C
        taps = tl.arange(0, TAPS)
        weights = tl.load(
            w_ptr + cs[:, None] * KERNEL + taps[None, :], mask=cmask[:, None] & (taps[None, :] < KERNEL), other=0.0
        ).to(tl.float32)  # [BLOCK_C, TAPS]
        b = tl.program_id(0)
        cols = tl.arange(0, FULL)
        row = tl.load(rows_ptr + b)
        start = tl.load(committed_ptr + row)
        pool_row = pool_ptr + row * stride_pr + cs[:, None] * stride_pc
        in_window = cols[None, :] < KERNEL - 1
        t_new = cols[None, :] - (KERNEL - 1)
        from_pool = tl.load(pool_row + start + cols[None, :], mask=cmask[:, None] & in_window, other=0.0)
        triton_utils.wait_for_previous_kernel(PDL)
        x_ptrs = x_ptr + b * stride_xb + t_new * stride_xt + cs[:, None]
        new_mask = cmask[:, None] & (t_new >= 0) & (t_new < T)
        from_x = tl.load(x_ptrs, mask=new_mask, other=0.0)
        full = tl.where(in_window, from_pool.to(tl.float32), from_x.to(tl.float32))  # [BLOCK_C, FULL]
        tl.debug_barrier()
        for t in tl.static_range(MAX_T):
            if t < T:
                acc = tl.zeros([BLOCK_C], dtype=tl.float32)
                for j in tl.static_range(KERNEL):
                    w = tl.sum(tl.where(taps[None, :] == j, weights, 0.0), axis=1)  # tap j's weight: exact (one term)
                    tap = tl.sum(tl.where(cols[None, :] == t + j, full, 0.0), axis=1)
                    acc += w * tap
                conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the conv's own rounding, as F.conv1d
                tl.store(
                    out_ptr + b * stride_ob + t * stride_ot + cs,
                    (conv * tl.sigmoid(conv)).to(out_ptr.dtype.element_ty),
                    mask=cmask,
                )
        keep = cmask[:, None] & (cols[None, :] >= 1) & (cols[None, :] < KERNEL - 1 + T) & (cols[None, :] - 1 < W)
        tl.store(pool_row + cols[None, :] - 1, full.to(pool_ptr.dtype.element_ty), mask=keep)

    return conv_update_window


@functools.cache
def _conv_update_columns_kernel():
    import triton
    import triton.language as tl

    # The same computation as `conv_update_window`, token by token and tap by tap in the same order (the tests
    # compare their bits), with each position a [BLOCK_C] vector instead of a column of one [BLOCK_C, 16] tile: a
    # thread holds its channels' 3 window values and 4 weights, not 16 columns of each, so a program of 1024 channels
    # takes the registers (compiled for sm_90: 128 a thread at 4 warps, 64 at 8) that the tile kernel spends on 128,
    # and a B32 step's 10,240 channels can run as 320 programs in one wave. Written for the Qwen models' 4 taps.
    @triton.jit(do_not_specialize=["T", "W", "stride_xb", "stride_xt", "stride_ob", "stride_pr"])
    def conv_update_columns(
        x_ptr, w_ptr, pool_ptr, rows_ptr, committed_ptr, out_ptr,
        T, C, W,
        stride_xb, stride_xt, stride_ob, stride_ot, stride_pr, stride_pc,
        KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, MAX_T: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        tl.static_assert(KERNEL == 4)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cs < C
        w0 = tl.load(w_ptr + cs * KERNEL + 0, mask=cmask, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + cs * KERNEL + 1, mask=cmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + cs * KERNEL + 2, mask=cmask, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + cs * KERNEL + 3, mask=cmask, other=0.0).to(tl.float32)
        # The window after the wait, unlike `conv_update_window`: read before it, FP8 27B B1 plain steps were 0.4%
        # slower on an H100, K=3 and B32 unchanged (docs/benchmark-log.md, thirty-ninth session).
        triton_utils.wait_for_previous_kernel(PDL)
        b = tl.program_id(0)
        row = tl.load(rows_ptr + b)
        start = tl.load(committed_ptr + row)
        pool_row = pool_ptr + row * stride_pr + cs * stride_pc
        win0 = tl.load(pool_row + start + 0, mask=cmask, other=0.0).to(tl.float32)
        win1 = tl.load(pool_row + start + 1, mask=cmask, other=0.0).to(tl.float32)
        win2 = tl.load(pool_row + start + 2, mask=cmask, other=0.0).to(tl.float32)
        x_row = x_ptr + b * stride_xb + cs
        for t in tl.static_range(MAX_T):
            if t < T:
                acc = tl.zeros([BLOCK_C], dtype=tl.float32)
                for j in tl.static_range(KERNEL):
                    # position t + j of the conv's input: a window value held in registers, or a new token (loaded
                    # again: an L1 hit after its first load)
                    if t + j == 0:
                        tap = win0
                    elif t + j == 1:
                        tap = win1
                    elif t + j == 2:
                        tap = win2
                    else:
                        tap = tl.load(x_row + (t + j - 3) * stride_xt, mask=cmask, other=0.0).to(tl.float32)
                    if j == 0:
                        w = w0
                    elif j == 1:
                        w = w1
                    elif j == 2:
                        w = w2
                    else:
                        w = w3
                    acc += w * tap
                conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the conv's own rounding, as F.conv1d
                tl.store(
                    out_ptr + b * stride_ob + t * stride_ot + cs,
                    (conv * tl.sigmoid(conv)).to(out_ptr.dtype.element_ty),
                    mask=cmask,
                )
        tl.debug_barrier()  # every window value is read before the pool is overwritten
        for p in tl.static_range(1, KERNEL - 1 + MAX_T):
            if (p < KERNEL - 1 + T) & (p - 1 < W):
                if p == 1:
                    value = win1
                elif p == 2:
                    value = win2
                else:
                    value = tl.load(x_row + (p - 3) * stride_xt, mask=cmask, other=0.0).to(tl.float32)
                tl.store(pool_row + (p - 1), value.to(pool_ptr.dtype.element_ty), mask=cmask)

    return conv_update_columns


def _conv_update_launch(default: tuple[int, int, str]) -> tuple[int, int, str]:
    """The conv update's launch: `default`, or QWEN_MTP_CONV_UPDATE="block,warps,kind" (e.g. "1024,8,columns": the
    benchmarks' A/B switch inside one tree)."""
    asked = os.environ.get("QWEN_MTP_CONV_UPDATE", "").strip()
    if not asked:
        return default
    block, warps, kind = asked.split(",")
    return int(block), int(warps), kind


# The conv update's launch (`benchmarks/small_kernels.py` times the choices on the GPU; none changes a number):
# channels per program, warps, and which kernel ("tile": `conv_update_window`, any kernel size; "columns":
# `conv_update_columns`, 4 taps; "auto": columns for one token a row, the tile kernel for more). Measured on an
# H100 (docs/benchmark-log.md, twenty-eighth session): at one token the column kernel took 1.53 / 2.41 / 5.15 us at
# B1 / B8 / B32 against the tile kernel's 1.75 / 2.75 / 8.17; at four tokens (a K=3 verify) the tile kernel was the
# faster (2.00 / 3.14 / 9.63 against 2.41 / 4.15 / 10.66).
CONV_UPDATE_BLOCK, CONV_UPDATE_WARPS, CONV_UPDATE_KERNEL = _conv_update_launch((128, 4, "auto"))


def conv_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    committed: torch.Tensor,
    block: int | None = None,
    warps: int | None = None,
    kind: str | None = None,
) -> torch.Tensor:
    """Triton version of `conv_update_reference` (same arguments, same in-place pool update). x may be a
    strided slice (the fused input projection's qkv part): read in place. `block` channels per program, `warps`
    and `kind` ("tile", "columns" or "auto"; defaults `CONV_UPDATE_BLOCK`, `CONV_UPDATE_WARPS`,
    `CONV_UPDATE_KERNEL`) spread the work and never change a number; "columns" needs a 4-tap kernel (the "tile"
    kernel runs others)."""
    import triton

    batch, length, channels = x.shape
    x = x if x.stride(2) == 1 else x.contiguous()
    weight = weight.contiguous()
    assert pool.stride(2) == 1
    out = x.new_empty(x.shape)
    block, warps = block or CONV_UPDATE_BLOCK, warps or CONV_UPDATE_WARPS
    kind = kind or CONV_UPDATE_KERNEL
    if kind not in ("tile", "columns", "auto"):
        raise ValueError(f"conv update kernel {kind!r}: 'tile', 'columns' or 'auto'")
    taps = weight.shape[1]
    if kind == "auto":
        kind = "columns" if length == 1 else "tile"
    max_t = 8  # the most tokens one call takes (K + 1 <= 5), fixed so the binary never depends on K or T
    assert length <= max_t
    grid = (batch, triton.cdiv(channels, block))
    args = (
        x, weight, pool, rows, committed, out, length, channels, pool.shape[2],
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), pool.stride(0), pool.stride(1),
    )  # fmt: skip
    if kind == "columns" and taps == 4:
        _conv_update_columns_kernel()[grid](
            *args, KERNEL=taps, BLOCK_C=block, MAX_T=max_t, num_warps=warps, **triton_utils.launch(x.device)
        )
        return out
    _conv_update_kernel()[grid](
        *args, KERNEL=taps, BLOCK_C=block, MAX_T=max_t, FULL=triton.next_power_of_2(taps - 1 + max_t),
        TAPS=triton.next_power_of_2(taps), num_warps=warps, **triton_utils.launch(x.device),
    )  # fmt: skip
    return out


@torch.library.custom_op("qwen_mtp::conv_update", mutates_args=("pool",))
def conv_update(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor
) -> torch.Tensor:
    """Custom op: `conv_update_reference` on CPU, the Triton kernel on CUDA."""
    return conv_update_reference(x, weight, pool, rows, committed).contiguous()


@cuda_kernel(conv_update)
def _(x, weight, pool, rows, committed):
    if reference_forced("conv_update"):
        return conv_update_reference(x, weight, pool, rows, committed).contiguous()
    return conv_update_triton(x, weight, pool, rows, committed)


@conv_update.register_fake
def _(x, weight, pool, rows, committed):
    return x.new_empty(x.shape)  # contiguous, as both implementations return
