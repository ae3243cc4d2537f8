"""RMSNorms as ops: the zero-centred `x_hat * (1 + w)` norm and the GDN's gated norm.

Why ops and not plain torch: PyTorch's CUDA reductions choose how to split a row's sum by the *number of
rows*, so a decode step over 8 rows and a verify step over 16 rows round `mean(x^2)` differently, and greedy
tokens drift apart (seen on the H200: MTP-on != MTP-off at batch 8 before this op). The Triton kernels give
each row one program that sums in a fixed order. The references are the exact Hugging Face computations and
run on CPU; backward differentiates the reference (`ops/autograd.py`), so fine-tuning works unchanged.
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import elementwise, triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.linear import empty_w8a8_input, quantize_activations_reference
from qwen_mtp.quant.fp8 import FP8_BLOCK, SCALE_FLOOR


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm, computed in fp32 and cast once (HF `Qwen3_5RMSNorm`)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool = False
) -> torch.Tensor:
    """GDN output norm: plain weight applied in the activation dtype, then the silu(gate) product in fp32.
    `invariant` (decode, verify): the silu rounds a row the same whatever the batch (`ops/elementwise.py`)."""
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(dtype)
    return (y * elementwise.silu(gate.float(), invariant)).to(dtype)


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (rms_norm(x + delta), x + delta), the sum in the activation dtype."""
    summed = x + delta
    return rms_norm_reference(summed, weight, eps), summed


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _norm_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_rows(
        x_ptr, g_ptr, w_ptr, out_ptr, d_ptr, sum_ptr, q_ptr, qs_ptr, N, eps, g_heads, g_s0, g_s1,
        GATED: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr,
        QUANT: tl.constexpr = False, FLOOR: tl.constexpr = 0.0, SLICE: tl.constexpr = 0, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program per row (but SLICE). WHOLE_ROW (N <= BLOCK): the row is loaded once and stays in registers,
        # one tree sum; its weights are loaded before the PDL wait (a parameter, which no kernel writes: at batch 1
        # a norm is all latency, and the load overlaps the previous kernel's tail). (`_row_block` says which rows.)
        # Otherwise the sum of squares runs over BLOCK-wide chunks in order, then one tree sum, and a second pass
        # normalizes. ADD: the row is x + delta, rounded to the activation dtype as the separate add would be, and
        # stored (the second pass adds again rather than reading the stores back: a thread may not read what
        # another thread of its program stored without a barrier, and with QUANT's regrouping the compiler lays
        # the second pass out otherwise than the first). GATED: row r's gate is at (r // g_heads) * g_s0 +
        # (r % g_heads) * g_s1 (per-head rows of a strided projection slice, read in place). QUANT: the output row
        # is also quantized for the W8A8 product it feeds (q_ptr [rows, N] e4m3, qs_ptr [rows, N / 128] fp32; N
        # and BLOCK multiples of 128). SLICE (WHOLE_ROW only, a power of two of groups of 128 dividing N): program
        # (row, s) sums the whole row as above, then writes only columns s * SLICE .. (s + 1) * SLICE, loaded again
        # (a program cannot pick its columns out of the row it holds in registers; `_quant_slice` says why slices).
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        if SLICE:
            part = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
            w_row = tl.load(w_ptr + part, mask=part < N, other=0.0)
        elif WHOLE_ROW:
            w_row = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        triton_utils.wait_for_previous_kernel(PDL)
        q_row, qs_row = q_ptr + row * N, qs_ptr + row * (N // 128)
        if SLICE:
            x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0)
            if ADD:
                d = tl.load(d_ptr + row * N + cols, mask=cols < N, other=0.0)
                x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
            x = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
            inside = part < N
            xs = tl.load(x_ptr + row * N + part, mask=inside, other=0.0)
            if ADD:
                ds = tl.load(d_ptr + row * N + part, mask=inside, other=0.0)
                xs = (xs.to(tl.float32) + ds.to(tl.float32)).to(xs.dtype)
                tl.store(sum_ptr + row * N + part, xs, mask=inside)
            y = triton_utils.scale_norm_row(xs.to(tl.float32), inv, w_row, g_ptr, row, part, inside, g_heads, g_s0,
                                            g_s1, GATED)  # fmt: skip
            y = y.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * N + part, y, mask=inside)
            if QUANT:
                triton_utils.store_e4m3_groups(y.to(tl.float32), q_row, qs_row, tl.program_id(1) * SLICE, N,
                                               SLICE // 128, FLOOR)  # fmt: skip
        elif WHOLE_ROW:
            mask = cols < N
            x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
            if ADD:
                d = tl.load(d_ptr + row * N + cols, mask=mask, other=0.0)
                x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
                tl.store(sum_ptr + row * N + cols, x, mask=mask)
            x = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
            y = triton_utils.scale_norm_row(x, inv, w_row, g_ptr, row, cols, mask, g_heads, g_s0, g_s1, GATED)
            y = y.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * N + cols, y, mask=mask)
            if QUANT:
                triton_utils.store_e4m3_groups(y.to(tl.float32), q_row, qs_row, 0, N, BLOCK // 128, FLOOR)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                mask = start + cols < N
                x = tl.load(x_ptr + row * N + start + cols, mask=mask, other=0.0)
                if ADD:
                    d = tl.load(d_ptr + row * N + start + cols, mask=mask, other=0.0)
                    x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
                    tl.store(sum_ptr + row * N + start + cols, x, mask=mask)
                x = x.to(tl.float32)
                acc += x * x
            inv = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
            for start in range(0, N, BLOCK):
                mask = start + cols < N
                x = tl.load(x_ptr + row * N + start + cols, mask=mask, other=0.0)
                if ADD:  # the sum again, not read back from sum_ptr: no thread relies on another's store
                    d = tl.load(d_ptr + row * N + start + cols, mask=mask, other=0.0)
                    x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
                x = x.to(tl.float32)
                w = tl.load(w_ptr + start + cols, mask=mask, other=0.0)
                y = triton_utils.scale_norm_row(x, inv, w, g_ptr, row, start + cols, mask, g_heads, g_s0, g_s1, GATED)
                y = y.to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + row * N + start + cols, y, mask=mask)
                if QUANT:
                    triton_utils.store_e4m3_groups(y.to(tl.float32), q_row, qs_row, start, N, BLOCK // 128, FLOOR)

    return rms_norm_rows


def norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    quantize: bool = False,
    slice_columns: int | None = None,
):
    """Triton version of `rms_norm_reference` (gate None), `gated_rms_norm_reference`, or (delta given)
    `add_rms_norm_reference`, which returns (normed, x + delta). `quantize`: also the normed rows' W8A8 activation
    quantization, (e4m3 [rows, N], fp32 scales [rows, N / 128]), appended to what it returns: the bytes and scales
    `quantize_activation_rows_triton` gives the normed rows (N a multiple of 128). `slice_columns` (benchmarks):
    columns a program writes on the one-pass quantizing path, 0 for the whole row (default `_quant_slice`)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    gates = rows[:, None] if gate is None else _per_head_rows(gate)
    deltas = rows if delta is None else delta.reshape(-1, n).contiguous()
    out = torch.empty_like(rows)
    summed = out if delta is None else torch.empty_like(rows)
    block, warps, whole_row = _row_block(n)
    if quantize and (n % FP8_BLOCK[1] or block % FP8_BLOCK[1]):
        raise ValueError(f"norm_triton(quantize=True) needs rows of a multiple of {FP8_BLOCK[1]}, got {n}")
    q, q_scale = empty_w8a8_input(rows, *rows.shape) if quantize else (out, out)
    part = (_quant_slice(n) if slice_columns is None else slice_columns) if quantize and whole_row else 0
    if part and (n % part or part % 128 or (part // 128) & (part // 128 - 1)):
        raise ValueError(f"norm_triton: rows of {n} do not cut into slices of {part} columns (2^i groups of 128)")
    _norm_kernel()[(rows.shape[0], n // part if part else 1)](
        rows, gates, weight, out, deltas, summed, q, q_scale, n, eps, gates.shape[1], gates.stride(0), gates.stride(1),
        GATED=gate is not None, ADD=delta is not None, BLOCK=block, WHOLE_ROW=whole_row, QUANT=quantize,
        FLOOR=SCALE_FLOOR, SLICE=part, num_warps=warps, **triton_utils.launch(rows.device),
    )  # fmt: skip
    normed = out.reshape(x.shape)
    results = (normed,) if delta is None else (normed, summed.reshape(x.shape))
    if quantize:
        return *results, q, q_scale
    return normed if delta is None else results


def _row_block(n: int) -> tuple[int, int, bool]:
    """(BLOCK, warps, whole row) for rows of n, from n alone (so every row count sums alike). Rows of 1025 to 8192
    stay in registers: a 5120-wide row in one load by 16 warps, not five dependent 1024-wide passes and a second
    read (at batch 1 a norm is all latency, ~130 of them a step). Up to 1024 wide (head dims, the GDN's gated
    norm) the chunked loop runs once, as `qk_norm_rope` sums: the two stay bitwise equal, which the one-pass sum
    is not in fp32 (measured on the H200: the compiler may fuse its squares into the sum as FMAs). Wider rows
    loop over 1024-wide chunks."""
    import triton

    block = triton.next_power_of_2(n)
    if block <= 1024:
        return block, 4, False
    if block <= 8192:
        return block, min(16, block // 512), True
    return 1024, 4, False


def _quant_slice(n: int) -> int:
    """Columns each program writes when a one-pass norm row (`_row_block`) also quantizes its output: the widest
    power of two of groups of 128, up to 1024, that divides n (1024 for the 27B's 5120). Each of the row's programs
    sums the whole row alone, in the one program's order, so every byte is the one-program kernel's. Why: one
    program quantizing a whole row regroups it [BLOCK / 128, 128] through shared memory, all latency at a few
    rows; measured on an H100 (`benchmarks/norm_costs.py`, 5120 wide) 3.3 us a launch at M = 1 against 1.55 us
    in 5 slices (1.5 us with no quantization), and still faster at M = 32 (2.0 against 3.4 us); 10 or more slices
    lose as rows grow."""
    groups = 8
    while n % (groups * 128):
        groups //= 2
    return groups * 128


def _per_head_rows(gate: torch.Tensor) -> torch.Tensor:
    """gate [..., heads, N] as [rows, heads, N] without a copy where its strides allow (the GDN's z, a slice of
    the fused input projection: [B, T, heads, N] with a row stride wider than heads * N)."""
    heads = gate.shape[-2] if gate.dim() > 2 else 1
    grouped = gate.reshape(-1, heads, gate.shape[-1])
    return grouped if grouped.stride(2) == 1 else grouped.contiguous()


@torch.library.custom_op("qwen_mtp::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Custom op: `rms_norm_reference` on CPU, the batch-invariant Triton kernel on CUDA."""
    return rms_norm_reference(x, weight, eps).contiguous()


@cuda_kernel(rms_norm)
def _(x, weight, eps):
    if reference_forced("rms_norm"):
        return rms_norm_reference(x, weight, eps).contiguous()
    return norm_triton(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)  # contiguous, as both implementations return


@torch.library.custom_op("qwen_mtp::gated_rms_norm", mutates_args=())
def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool = False
) -> torch.Tensor:
    """Custom op: `gated_rms_norm_reference` on CPU, the batch-invariant Triton kernel on CUDA (invariant
    either way: one program per row)."""
    return gated_rms_norm_reference(x, gate, weight, eps, invariant).contiguous()


@cuda_kernel(gated_rms_norm)
def _(x, gate, weight, eps, invariant=False):
    if reference_forced("gated_rms_norm"):
        return gated_rms_norm_reference(x, gate, weight, eps, invariant).contiguous()
    return norm_triton(x, weight, eps, gate)


@gated_rms_norm.register_fake
def _(x, gate, weight, eps, invariant=False):
    return x.new_empty(x.shape)


@torch.library.custom_op("qwen_mtp::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: (rms_norm(x + delta), x + delta) in one pass over the row on CUDA (one launch instead of
    two per residual add); `add_rms_norm_reference` on CPU."""
    normed, summed = add_rms_norm_reference(x, delta, weight, eps)
    return normed.contiguous(), summed.contiguous()


@cuda_kernel(add_rms_norm)
def _(x, delta, weight, eps):
    if reference_forced("add_rms_norm"):
        normed, summed = add_rms_norm_reference(x, delta, weight, eps)
        return normed.contiguous(), summed.contiguous()
    return norm_triton(x, weight, eps, delta=delta)


@add_rms_norm.register_fake
def _(x, delta, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def norm_w8a8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, summed, q, q_scale): normed (and summed = x + delta, else an empty tensor) as the norm's own
    reference gives them (`gated_rms_norm_reference` with a gate, `add_rms_norm_reference` with a delta, else
    `rms_norm_reference`), then the normed rows' W8A8 quantization (`quantize_activations_reference`)."""
    if gate is not None:
        normed, summed = gated_rms_norm_reference(x, gate, weight, eps, invariant), x.new_empty(0)
    elif delta is not None:
        normed, summed = add_rms_norm_reference(x, delta, weight, eps)
    else:
        normed, summed = rms_norm_reference(x, weight, eps), x.new_empty(0)
    q, q_scale = quantize_activations_reference(normed.reshape(-1, x.shape[-1]))
    return normed.contiguous(), summed.contiguous(), q, q_scale


@torch.library.custom_op("qwen_mtp::norm_w8a8", mutates_args=())
def norm_w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Custom op: a norm that also quantizes its output for the W8A8 product it feeds (`norm_w8a8_reference`).
    q and q_scale are the very bytes the product's own quantization launch would write, so `linear_fp8(...,
    x_q=q, x_scale=q_scale)` skips that launch and changes no bit. On CUDA one launch (the norm kernel with
    QUANT: 240 of the 256 quantization launches of a 27B FP8 step are a norm's or SwiGLU's), on CPU the
    reference."""
    return norm_w8a8_reference(x, weight, eps, gate, delta, invariant)


@cuda_kernel(norm_w8a8)
def _(x, weight, eps, gate=None, delta=None, invariant=False):
    if reference_forced("norm_w8a8"):
        return norm_w8a8_reference(x, weight, eps, gate, delta, invariant)
    results = norm_triton(x, weight, eps, gate, delta, quantize=True)
    if delta is None:
        return results[0], x.new_empty(0), *results[1:]
    return results


@norm_w8a8.register_fake
def _(x, weight, eps, gate=None, delta=None, invariant=False):
    summed = x.new_empty(x.shape) if delta is not None else x.new_empty(0)
    return x.new_empty(x.shape), summed, *empty_w8a8_input(x, x.numel() // x.shape[-1], x.shape[-1])


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)

for _op, _reference in (
    (rms_norm, rms_norm_reference),
    (gated_rms_norm, gated_rms_norm_reference),
    (add_rms_norm, add_rms_norm_reference),
):
    register_reference_autograd(_op, _reference)
