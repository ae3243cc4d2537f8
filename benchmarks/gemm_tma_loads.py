"""`GemmPlan.tma_loads` on the decode GEMMs (issues #13, #14): each row count's plan as the engine runs it (its row
bucket's, `row_plan`), with its tiles loaded by pointers and by the tensor memory accelerator, against cuBLAS bf16.

For the bf16 kernel at a preset's decode shapes (lm_head included) and the W8A8 kernel at its FP8 shapes, at
M = 1 .. 256: microseconds per GEMM under a CUDA graph with the weights rotated past L2 (the W8A8 figures include
its activation quantization launch), and whether the two loads give the same bits (they must: the same tiles, the
same MMAs). The report (--out) says per shape and M which loads won; applying them to the plan tables is by hand.

Usage (H200): python3 benchmarks/gemm_tma_loads.py [--preset qwen3.5-27b] [--kinds bf16,w8a8] [--out report.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
from gemm_buckets import KINDS
from gemm_family import DECODE_M, ROTATION_BYTES, graph_us

from qwen_mtp.ops.linear import W8A8_ROW_BUCKETS, gemm_plan_w8a8, row_plan


def engine_plan(kind: str, n: int, k: int, m: int):
    """The plan the engine runs for m rows of an [N, K] weight of this kind."""
    if kind == "w8a8":
        return row_plan(n, k, m, True, W8A8_ROW_BUCKETS, gemm_plan_w8a8)
    return row_plan(n, k, m)


def measure(kind_name: str, preset: str) -> list[dict]:
    kind = KINDS[kind_name]
    rows = []
    for name, (n, k) in kind.shapes(preset, "").items():
        element = 1 if kind_name == "w8a8" else 2
        copies = max(2, min(16, ROTATION_BYTES // (n * k * element)))
        ours, bf16 = kind.weights(n, k, copies)
        x = torch.randn(max(DECODE_M), k, device="cuda", dtype=torch.bfloat16)
        for m in DECODE_M:
            plan = engine_plan(kind_name, n, k, m)
            loads = dataclasses.replace(plan, tma_loads=True)
            same = torch.equal(kind.call(x[:m], ours[0], plan), kind.call(x[:m], ours[0], loads))
            pointer_us = graph_us(lambda a, w, p=plan: kind.call(a, w, p), x[:m], ours)
            tma_us = graph_us(lambda a, w, p=loads: kind.call(a, w, p), x[:m], ours)
            cublas_us = graph_us(lambda a, w: F.linear(a, w), x[:m], bf16)
            row = dict(kind=kind_name, shape=name, n=n, k=k, m=m, plan=repr(plan), same_bits=same,
                       pointer_us=pointer_us, tma_us=tma_us, cublas_us=cublas_us)  # fmt: skip
            rows.append(row)
            ratio = pointer_us / cublas_us
            print(f"{kind_name:5s} {name[:28]:28s} M={m:3d}: pointers {pointer_us:7.1f} us ({ratio:.2f}x cuBLAS), "
                  f"TMA {tma_us:7.1f} us ({tma_us / cublas_us:.2f}x), TMA/pointers {tma_us / pointer_us:.3f}, "
                  f"same bits {same}")  # fmt: skip
        del ours, bf16, x
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--kinds", default="bf16,w8a8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset, "rows": []}
    for kind in args.kinds.split(","):
        report["rows"] += measure(kind, args.preset)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
