"""Packed prefill rows of FP8 block weights (issue #20 on issue #14's weights): the W8A8 "tma" plans
(`ops.linear.prefill_plan_w8a8`, and the candidates below) against what prefills of FP8 weights run otherwise.

For each FP8 weight shape of a preset (27B FP8 by default) and M in --rows, under CUDA graphs:
- scaled_mm: the activation quantization + cuBLASLt's blockwise W8A8 GEMM (unpacked prefills; not invariant);
- w8a16 grid: the W8A16 "grid" plan (what packed prefill rows ran before the W8A8 prefill plans);
- cuBLAS bf16 on the dequantized weight (what the bf16 model's prefill costs);
- each W8A8 "tma" candidate (the activation quantization included, as the linear op runs it);
and in the same run the bits: each candidate's rows at M = 1, 129 and the smallest --rows equal the same rows of
the largest M, and a middle row alone. Then one forward's FP8 linears summed per method (each shape times its count
of modules). `--apply` writes the fastest invariant candidate per shape (over all --rows, as ratios to scaled_mm)
into `PREFILL_TUNED_W8A8` (ops/linear.py).

Usage (H200): python3 benchmarks/gemm_prefill_fp8.py [--preset qwen3.5-27b-fp8] [--rows 512,2048,4096]
[--out report.json] [--apply]
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from gemm_family import _error, graph_us
from gemm_fp8 import fp8_shapes, random_fp8
from gemm_prefill import cli, decoder_shape_counts, write_plan_table

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import (
    GemmPlan,
    dequantize_triton,
    invariant_matmul_triton,
    linear_fp8_w8a8_triton,
    scaled_mm_linear,
    scaled_mm_supported,
)


def shape_counts(preset: str) -> dict[tuple[int, int], int]:
    """(N, K) -> how many FP8 modules of that shape one prefill forward's decoder layers run."""
    return decoder_shape_counts(preset, fp8_shapes(preset))


def candidates(n: int, k: int) -> dict[str, GemmPlan]:
    """W8A8 "tma" plans: 128-deep blocks (one activation scale group), the whole K loop in one program."""
    blocks = -(-k // 128)
    return {
        "default": linear.prefill_plan_w8a8(n, k),
        "128x128s3": GemmPlan(128, 128, blocks, 8, 3, "tma", 128),
        "128x128s4p": GemmPlan(128, 128, blocks, 8, 4, "tma", 128, persistent=True),
        "128x128s4g16": GemmPlan(128, 128, blocks, 8, 4, "tma", 128, group_m=16),
        "64x128s4w4": GemmPlan(128, 128, blocks, 4, 4, "tma", 64),
        "128x64s4w4": GemmPlan(64, 128, blocks, 4, 4, "tma", 128),
        "128x256s3": GemmPlan(256, 128, blocks, 8, 3, "tma", 128),
        "256x128s3": GemmPlan(128, 128, blocks, 8, 3, "tma", 256),
    }


def run(preset: str, rows: list[int]) -> dict:
    torch.manual_seed(0)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": preset, "rows": rows,
                    "shapes": []}  # fmt: skip
    big = max(rows)
    forward: dict[int, dict[str, float]] = {m: {} for m in rows}
    for (n, k), count in shape_counts(preset).items():
        weight, scale = random_fp8(n, k, seed=0)
        dense = dequantize_triton(weight, scale, torch.bfloat16)
        x = torch.randn(big, k, device="cuda", dtype=torch.bfloat16)
        grid = linear.grid_prefill_plan(n, k)
        baselines = {
            "cublas bf16": (lambda a, w: F.linear(a, w), dense),
            "w8a16 grid": (lambda a, w, p=grid: invariant_matmul_triton(a, w[0], p, scale=w[1]), (weight, scale)),
        }
        if scaled_mm_supported(x, weight):
            baselines["scaled_mm"] = (lambda a, w: scaled_mm_linear(a, w[0], w[1]), (weight, scale))
        entry = {"n": n, "k": k, "count": count, "us": {}, "plans": {}}
        for name, (fn, w) in baselines.items():
            entry["us"][name] = {m: graph_us(fn, x[:m], [w]) for m in rows}
        for name, plan in candidates(n, k).items():
            e = entry["plans"][name] = {"plan": repr(plan), "fields": dataclasses.asdict(plan)}
            fn = lambda a, w, p=plan: linear_fp8_w8a8_triton(a, w[0], w[1], p)  # noqa: E731
            try:
                full = fn(x, (weight, scale))
                middle = slice(big // 2, big // 2 + 1)
                e["invariant"] = all(
                    torch.equal(fn(x[:m], (weight, scale)), full[:m]) for m in (1, 129, min(rows))
                ) and torch.equal(fn(x[middle], (weight, scale)), full[middle])
                e["error_vs_bf16"] = ((full.float() - F.linear(x, dense).float()).norm() / full.float().norm()).item()
                e["us"] = {m: graph_us(fn, x[:m], [(weight, scale)]) for m in rows}
            except Exception as err:  # a plan that does not compile (shared memory) is reported, not fatal
                e["error"] = _error(err)
        usable = {a: b for a, b in entry["plans"].items() if b.get("invariant")}
        base = entry["us"].get("scaled_mm", entry["us"]["cublas bf16"])
        cost = {a: sum(b["us"][m] / base[m] for m in rows) for a, b in usable.items()}
        entry["best"] = best = min(cost, key=cost.get) if cost else None
        for m in rows:
            f = forward[m]
            for name, us in entry["us"].items():
                f[name] = f.get(name, 0.0) + us[m] * count
            for name in ("default", best):
                if name and "us" in entry["plans"][name]:
                    label = "w8a8 " + ("default" if name == "default" else "best")
                    f[label] = f.get(label, 0.0) + entry["plans"][name]["us"][m] * count
        report["shapes"].append(entry)
        print(f"{n}x{k} (x{count}), us at M = {rows}; best {best}")
        for name, us in entry["us"].items():
            print(f"  {name:14s} " + " ".join(f"{us[m]:8.1f}" for m in rows))
        for name, e in entry["plans"].items():
            if "error" in e:
                print(f"  {name:14s} ERROR {e['error']}")
                continue
            print(f"  {name:14s} " + " ".join(f"{e['us'][m]:8.1f} ({e['us'][m] / base[m]:.2f}x)" for m in rows)
                  + f"  invariant {e['invariant']}, error vs bf16 {e['error_vs_bf16']:.2e}")  # fmt: skip
        del weight, scale, dense, x
        torch.cuda.empty_cache()
    report["forward_ms"] = {m: {a: us / 1e3 for a, us in f.items()} for m, f in forward.items()}
    for m, f in report["forward_ms"].items():
        print(f"one forward's FP8 linears at M={m}: " + ", ".join(f"{a} {ms:.2f} ms" for a, ms in f.items()))
    return report


def apply(report: dict, path: str = "qwen_mtp/ops/linear.py") -> None:
    """Write each shape's best invariant candidate into PREFILL_TUNED_W8A8 (other shapes' entries stay)."""
    table = dict(linear.PREFILL_TUNED_W8A8)
    for e in report["shapes"]:
        if e["best"]:
            table[e["n"], e["k"]] = GemmPlan(**e["plans"][e["best"]]["fields"])
    write_plan_table(table, "PREFILL_TUNED_W8A8", path)


if __name__ == "__main__":
    cli(__doc__, "qwen3.5-27b-fp8", "512,2048,4096", run, apply, "PREFILL_TUNED_W8A8")
