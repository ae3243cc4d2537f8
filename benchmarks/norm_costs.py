"""What a quantizing norm costs at one row, and whether spreading its quantization over programs helps (issue #14).

In the 27B FP8 B1 step (thirty-fifth session, H100, PDL off) the norms took 177 launches of 3.5 us, the bf16
model's (which quantize nothing) 2.0 us: the W8A8 quantization the norm does for the GEMM it feeds
(`norm.norm_triton(quantize=True)`) is ~1.5 us a launch, all latency at one row. The engine runs one program per
row; the whole 5120-wide row sits in 16 warps' registers and its 40 groups of 128 are quantized there.

This script times, under a CUDA graph of back-to-back launches (PDL as the engine has it), for the 27B's 5120-wide
rows at M = 1, 8, 32, plain (input norm) and with the residual add (post-attention norm):
- the engine's norm without quantization and with it;
- `spread`: SLICES programs a row. Each loads the whole row and sums its squares exactly as the engine's one-pass
  path does (same block, same warps, same expression), then normalizes, stores and quantizes only its slice of
  columns (and stores its slice of the residual sum). The slice's arithmetic is the engine's, element for element,
  so the outputs should be the engine's bytes; each variant's are compared with the engine's, and a differing one
  is reported, not timed as a candidate.

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/norm_costs.py [--out PATH]
"""

from __future__ import annotations

import argparse
import functools

import torch
from gemm_family import write_json
from small_kernels import graphed_us

from qwen_mtp.ops import norm, triton_utils
from qwen_mtp.quant.fp8 import SCALE_FLOOR

N = 5120  # the 27B's hidden size
ROWS = (1, 8, 32)
SLICES = (5, 10, 20, 40)  # programs a row: slices of 1024 .. 128 columns (a power of two of whole groups of 128)


@functools.cache
def _spread_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def spread_norm(
        x_ptr, w_ptr, out_ptr, d_ptr, sum_ptr, q_ptr, qs_ptr, N, eps,
        ADD: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr, FLOOR: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # Program (row, s): the row's 1/rms as `norm._norm_kernel`'s WHOLE_ROW path computes it, then columns
        # s * SLICE .. (s + 1) * SLICE: normalized, stored, quantized (and the residual sum's slice stored).
        row, s = tl.program_id(0), tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        part = s * SLICE + tl.arange(0, SLICE)
        w_part = tl.load(w_ptr + part, mask=part < N, other=0.0)
        triton_utils.wait_for_previous_kernel(PDL)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
        if ADD:
            d = tl.load(d_ptr + row * N + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        inside = part < N
        xs = tl.load(x_ptr + row * N + part, mask=inside, other=0.0)
        if ADD:
            ds = tl.load(d_ptr + row * N + part, mask=inside, other=0.0)
            xs = (xs.to(tl.float32) + ds.to(tl.float32)).to(xs.dtype)
            tl.store(sum_ptr + row * N + part, xs, mask=inside)
        y = triton_utils.scale_norm_row(xs.to(tl.float32), inv, w_part, x_ptr, row, part, inside, 1, 0, 0, False)
        y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * N + part, y, mask=inside)
        triton_utils.store_e4m3_groups(y.to(tl.float32), q_ptr + row * N, qs_ptr + row * (N // 128), s * SLICE, N,
                                       SLICE // 128, FLOOR)  # fmt: skip

    return spread_norm


def spread_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, slices: int, delta: torch.Tensor | None = None):
    """`norm.norm_triton(x, weight, eps, delta=delta, quantize=True)`'s outputs, each row by `slices` programs (the
    engine's one-pass rows, 1025..8192 wide, cut into `slices` slices of a power of two of whole groups of 128)."""
    rows, n = x.shape
    block, warps, whole_row = norm._row_block(n)
    width = n // slices
    if not whole_row or n % slices or width % 128 or (width // 128) & (width // 128 - 1):
        raise ValueError(f"spread_norm: rows of {n} do not cut into {slices} slices of 2^i groups of 128")
    out = torch.empty_like(x)
    summed = out if delta is None else torch.empty_like(x)
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    q_scale = torch.empty(rows, n // 128, dtype=torch.float32, device=x.device)
    _spread_kernel()[(rows, slices)](
        x, weight, out, x if delta is None else delta, summed, q, q_scale, n, eps, ADD=delta is not None,
        BLOCK=block, SLICE=width, FLOOR=SCALE_FLOOR, num_warps=warps, **triton_utils.launch(x.device),
    )  # fmt: skip
    return (out, q, q_scale) if delta is None else (out, summed, q, q_scale)


def engine_norm(x, weight, eps, delta=None, quantize=True):
    """The engine's norm as the FP8 model calls it (outputs as `spread_norm` returns them when quantizing)."""
    return norm.norm_triton(x, weight, eps, delta=delta, quantize=quantize)


def same_bytes(a: tuple, b: tuple) -> bool:
    return all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b, strict=True))


def time_case(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None) -> dict:
    """us per launch of every variant on rows x (with the residual add when `delta`), and which differ in bytes."""
    engine = engine_norm(x, weight, 1e-6, delta)
    case = dict(m=x.shape[0], add=delta is not None, us={}, differs=[])
    case["us"]["engine, no quantization"] = graphed_us(lambda: engine_norm(x, weight, 1e-6, delta, False))
    case["us"]["engine"] = graphed_us(lambda: engine_norm(x, weight, 1e-6, delta))
    for slices in SLICES:
        label = f"spread {slices}"
        if not same_bytes(spread_norm(x, weight, 1e-6, slices, delta), engine):
            case["differs"].append(label)
        case["us"][label] = graphed_us(functools.partial(spread_norm, x, weight, 1e-6, slices, delta))
    return case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    report = dict(device=torch.cuda.get_device_name(), n=N, cases=[])
    gen = torch.Generator("cuda").manual_seed(0)
    weight = (torch.randn(N, device="cuda", generator=gen) * 0.1).bfloat16()
    for m in ROWS:
        x = torch.randn(m, N, device="cuda", generator=gen).bfloat16()
        delta = torch.randn(m, N, device="cuda", generator=gen).bfloat16()
        for case in (time_case(x, weight, None), time_case(x, weight, delta)):
            report["cases"].append(case)
            cells = "  ".join(f"{k} {v:.2f}" for k, v in case["us"].items())
            kind = "add+norm" if case["add"] else "norm    "
            print(f"M={m:2d} {kind} us: {cells}  differs {case['differs'] or '-'}", flush=True)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
