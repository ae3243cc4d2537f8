"""What the quantizing norm costs at one row, by how many programs share a row (issue #14).

In the 27B FP8 B1 step (thirty-fifth session, H100, PDL off) the norms took 177 launches of 3.5 us, the bf16
model's (which quantize nothing) 2.0 us: the W8A8 quantization the norm does for the GEMM it feeds
(`norm.norm_triton(quantize=True)`) cost ~1.5 us a launch when one program held and quantized a whole 5120-wide
row. The engine now cuts the row over programs (`norm._quant_slice`): each sums the whole row alone, then
normalizes, stores and quantizes its slice.

This script times, under a CUDA graph of back-to-back launches (PDL as the engine has it), for the 27B's 5120-wide
rows at M = 1, 8, 32, plain (input norm) and with the residual add (post-attention norm):
- the norm without quantization;
- the quantizing norm with one program a row (`slice_columns=0`) and with 5, 10, 20 and 40 programs a row (slices
  of 1024 .. 128 columns; the engine's default is marked). Each variant's bytes (normed rows, residual sums, e4m3
  values and scales) are compared with the one-program kernel's; a differing one is reported.

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/norm_costs.py [--out PATH]
"""

from __future__ import annotations

import argparse
import functools

import torch
from gemm_family import write_json
from small_kernels import graphed_us

from qwen_mtp.ops import norm

N = 5120  # the 27B's hidden size
ROWS = (1, 8, 32)
SLICES = (5, 10, 20, 40)  # programs a row: slices of 1024 .. 128 columns (a power of two of whole groups of 128)


def engine_norm(x, weight, eps, delta=None, quantize=True, slice_columns=None):
    """The engine's norm as the FP8 model calls it, its row cut into slices of `slice_columns` (0: one program)."""
    return norm.norm_triton(x, weight, eps, delta=delta, quantize=quantize, slice_columns=slice_columns)


def same_bytes(a: tuple, b: tuple) -> bool:
    return all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b, strict=True))


def time_case(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None) -> dict:
    """us per launch of every variant on rows x (with the residual add when `delta`), and which differ in bytes."""
    whole = engine_norm(x, weight, 1e-6, delta, slice_columns=0)
    default = norm._quant_slice(N)
    case = dict(m=x.shape[0], add=delta is not None, us={}, differs=[], default_slice=default)
    case["us"]["no quantization"] = graphed_us(lambda: engine_norm(x, weight, 1e-6, delta, False))
    case["us"]["one program"] = graphed_us(lambda: engine_norm(x, weight, 1e-6, delta, slice_columns=0))
    for slices in SLICES:
        label = f"{slices} programs" + (" (default)" if N // slices == default else "")
        if not same_bytes(engine_norm(x, weight, 1e-6, delta, slice_columns=N // slices), whole):
            case["differs"].append(label)
        case["us"][label] = graphed_us(functools.partial(engine_norm, x, weight, 1e-6, delta, True, N // slices))
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
