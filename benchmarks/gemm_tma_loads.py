"""`GemmPlan.tma_loads` on the decode GEMMs (issues #13, #14): each row count's plan as the engine runs it (its row
bucket's, `row_plan`), with its tiles loaded by pointers and by the tensor memory accelerator, against cuBLAS bf16.

For the bf16 kernel at a preset's decode shapes (lm_head included) and the W8A8 kernel at its FP8 shapes, at
M = 1 .. 256: microseconds per GEMM under a CUDA graph with the weights rotated past L2 (the W8A8 figures include
its activation quantization launch), and whether the two loads give the same bits (they must: the same tiles, the
same MMAs). `--apply` writes ops/linear.py's `TMA_LOAD_BUCKETS` from the figures (`pick_tma_buckets`: a row bucket
loads by TMA where it never took more than 1.01x the pointer loads' time at an M measured in it and 0.97x on
average, with the same bits); `--from REPORT` applies a report measured before, without a GPU.

Usage (H200): python3 benchmarks/gemm_tma_loads.py [--preset qwen3.5-27b] [--kinds bf16,w8a8] [--out report.json]
              [--apply]
Usage (anywhere): python3 benchmarks/gemm_tma_loads.py --from report.json --apply
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os

import torch
import torch.nn.functional as F
from gemm_buckets import KINDS, replace_block
from gemm_family import DECODE_M, ROTATION_BYTES, graph_us

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import row_plan

MOST_SLOWER, MOST_ON_AVERAGE = 1.01, 0.97  # TMA / pointer time: at every M of a bucket, and on average


def engine_plan(kind: str, n: int, k: int, m: int):
    """The plan the engine runs for m rows of an [N, K] weight of this kind, with pointer loads."""
    plan = row_plan(n, k, m, True, getattr(linear, KINDS[kind].table), KINDS[kind].base, {})
    return dataclasses.replace(plan, tma_loads=False)


def bucket_start(kind: str, n: int, k: int, m: int) -> int:
    """The fewest rows of the row bucket a launch of m rows falls in (1: the shape's own plan)."""
    buckets = getattr(linear, KINDS[kind].table).get((n, k), ())
    return max((fewest for fewest, _ in buckets if m >= fewest), default=1)


def pick_tma_buckets(rows: list[dict]) -> dict[str, dict[tuple[int, int], tuple[int, ...]]]:
    """Per kernel and shape, the row buckets whose launches load by TMA: at no M measured in the bucket slower than
    MOST_SLOWER x the pointer loads, at most MOST_ON_AVERAGE x on average, and the same bits at every M."""
    ratios = collections.defaultdict(list)
    for r in rows:
        key = (r["kind"], r["n"], r["k"], bucket_start(r["kind"], r["n"], r["k"], r["m"]))
        ratios[key].append(r["tma_us"] / r["pointer_us"] if r["same_bits"] else float("inf"))
    table = {kind: collections.defaultdict(list) for kind in KINDS}
    for (kind, n, k, start), rs in sorted(ratios.items()):
        if max(rs) <= MOST_SLOWER and sum(rs) / len(rs) <= MOST_ON_AVERAGE:
            table[kind][n, k].append(start)
    return {kind: {shape: tuple(starts) for shape, starts in shapes.items()} for kind, shapes in table.items()}


def write_tma_buckets(table: dict[str, dict[tuple[int, int], tuple[int, ...]]], path: str | None = None) -> None:
    """Replace `TMA_LOAD_BUCKETS` between its markers in ops/linear.py (or the file at `path`)."""
    lines = ["TMA_LOAD_BUCKETS: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {"]
    for kind, shapes in table.items():
        lines.append(f'    "{kind}": {{')
        for (n, k), starts in sorted(shapes.items()):
            lines.append(f"        ({n}, {k}): ({', '.join(map(str, starts))}{',' if len(starts) == 1 else ''}),")
        lines.append("    },")
    lines.append("}")
    replace_block(path or os.path.abspath(linear.__file__), "TMA_LOAD_BUCKETS", lines)


def measure(kind_name: str, preset: str) -> list[dict]:
    kind = KINDS[kind_name]
    rows = []
    for name, (n, k) in kind.shapes(preset, "").items():
        copies = max(2, min(16, ROTATION_BYTES // (n * k * kind.stage_bytes)))
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
    parser.add_argument("--apply", action="store_true", help="write TMA_LOAD_BUCKETS in ops/linear.py")
    parser.add_argument("--from", dest="report", default=None, help="a report measured before (no GPU needed)")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            report = json.load(f)
    else:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset}
        report["rows"] = [row for kind in args.kinds.split(",") for row in measure(kind, args.preset)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    table = pick_tma_buckets(report["rows"])
    for kind, shapes in table.items():
        print(f"{kind}: row buckets loading by TMA", {f"{n}x{k}": starts for (n, k), starts in shapes.items()})
    if args.apply:
        write_tma_buckets(table)


if __name__ == "__main__":
    main()
