"""The W8A8 block-FP8 decode GEMM on the GPU (`model.fp8_decode: w8a8`) at a preset's FP8 shapes, under
CUDA graphs with weights rotated past L2: W8A8 (its activation quantization launch included, and the GEMM alone)
against the W8A16 plans in use (`gemm_plan_fp8`), our bf16 kernel and cuBLAS bf16 at M = 1 .. 128, with W8A8 rows
checked bitwise across M (`gemm_family.invariance_failures`: M up to 256, permuted rows, rows alone), its error
against its reference and against the bf16 product on the dequantized weight, and the percent of the copy
bandwidth (bytes read: e4m3 weight + fp32 scales + bf16 activations and output). `--family` instead times the
W8A8 plan family (`W8A8_VARIANTS` at their K splits and the current plan, every plan's rows checked bitwise
across M) and prints the winners as `TUNED_W8A8` entries for ops/linear.py; `--tiles` instead times the engine's
launch of M = 1..32 rows with 16-row and 32-row tiles (`tiles_table`). The JSON report goes to --out (default:
$OUT/gemm-w8a8.json, --family: $OUT/gemm-w8a8-family.json, --tiles: $OUT/gemm-w8a8-tiles.json).
Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/gemm_w8a8.py [qwen3.5-27b] [name filter] [--family |
--tiles]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
from gemm_family import _error, _with_splits, graph_us, invariance_failures, named_once, precompile, split_choices
from gemm_fp8 import ROTATE_BYTES, fp8_shapes, random_fp8

from qwen_mtp.bench import copy_bandwidth
from qwen_mtp.ops.linear import (
    TMA_LOAD_BUCKETS,
    W8A8_ROW_BUCKETS,
    GemmPlan,
    dequantize_triton,
    gemm_plan,
    gemm_plan_fp8,
    gemm_plan_w8a8,
    invariant_matmul_triton,
    linear_fp8_w8a8_triton,
    quantize_activation_rows_triton,
    row_plan,
    w8a8_block_products_reference,
    w8a8_matmul_triton,
)
from qwen_mtp.testing.synthetic import synthetic_config

DECODE_M = (1, 2, 4, 8, 16, 32, 64, 96, 128)
FAMILY_M = (1, 8, 16, 32, 64, 128)
CHOICE_M = (1, 8, 16, 32, 64)  # the decode / verify row counts a plan is chosen for

# The W8A8 plan family: name -> tile shape (K split chosen per weight shape). Every K block is one 128-column
# activation scale group; an e4m3 stage is half a bf16 one, so deeper pipelines fit.
#  s128: 128 weight rows (two warpgroups' wgmma A side), swapped; 32x4 is the default (`gemm_plan_w8a8`).
#  s64: 64 weight rows, one warpgroup: twice the programs (a fuller last wave on wide shapes).
#  s256: 256 weight rows, 8 warps: half the programs, each weight pass twice as long.
#  u64: unswapped 64-row tiles (the rows are wgmma's 64-row side: wasted at M = 1, full at M = 64+).
W8A8_VARIANTS: dict[str, GemmPlan] = {
    "s128 32x4": GemmPlan(128, 128, 1, 8, 4, "stream", 32, 4, True),
    "s128 32x4 st3": GemmPlan(128, 128, 1, 8, 3, "stream", 32, 4, True),
    "s128 32x4 st6": GemmPlan(128, 128, 1, 8, 6, "stream", 32, 4, True),
    "s128 16x4 st6": GemmPlan(128, 128, 1, 8, 6, "stream", 16, 4, True),
    "s128 16x8": GemmPlan(128, 128, 1, 8, 4, "stream", 16, 8, True),
    "s128 64x2": GemmPlan(128, 128, 1, 8, 4, "stream", 64, 2, True),
    "s64 32x4": GemmPlan(64, 128, 1, 4, 4, "stream", 32, 4, True),
    "s64 16x4 st8": GemmPlan(64, 128, 1, 4, 8, "stream", 16, 4, True),
    "s256 32x4": GemmPlan(256, 128, 1, 8, 3, "stream", 32, 4, True),
    "u64 64x2": GemmPlan(128, 128, 1, 4, 4, "stream", 64, 2, False),
    # 16-row tiles with deeper pipelines: at M <= 16 (the shape's own plan since the row buckets take 17 rows on)
    # a program's bytes in flight are its stages x weight block.
    "s64 16x4 st6": GemmPlan(64, 128, 1, 4, 6, "stream", 16, 4, True),
    "s64 16x2 st8": GemmPlan(64, 128, 1, 4, 8, "stream", 16, 2, True),
    "s128 16x4 st8": GemmPlan(128, 128, 1, 8, 8, "stream", 16, 4, True),
    "s128 16x2 st8 w4": GemmPlan(128, 128, 1, 4, 8, "stream", 16, 2, True),
}


def family_shapes(preset: str, draft_lm_head: bool) -> dict[str, tuple[int, int]]:
    """The shapes a family sweep times: the preset's FP8 weights, or (`--draft-lm-head`) the FP8 copy of its lm_head
    that `mtp.draft_lm_head: fp8` makes for the draft steps (vocabulary x hidden; not a checkpoint weight)."""
    if not draft_lm_head:
        return fp8_shapes(preset)
    config = synthetic_config(preset)
    return {"draft lm_head (fp8 copy)": (config.vocab_size, config.hidden_size)}


def w8a8(plan: GemmPlan | None = None):
    """The decode op: activation quantization + GEMM (two launches)."""
    return lambda x, wq: linear_fp8_w8a8_triton(x, wq[0], wq[1], plan)


def rotated_weights(n: int, k: int):
    """Enough e4m3 weight copies (bf16-valued block scales) to rotate past L2, and bf16 dequantizations."""
    copies = max(2, -(-ROTATE_BYTES // (n * k)))
    fp8 = [random_fp8(n, k, seed) for seed in range(copies)]
    dense = [dequantize_triton(q, s, torch.bfloat16) for q, s in fp8[: max(2, copies // 2)]]
    return fp8, dense


def bytes_read(n: int, k: int, wq, m: int) -> int:
    """What a W8A8 product of M rows must move: the e4m3 weight, its fp32 block scales, bf16 rows in and out."""
    return n * k + 4 * wq[1].numel() + 2 * m * (n + k)


def errors(x: torch.Tensor, wq, plan: GemmPlan) -> dict[str, float]:
    """Relative (Frobenius) errors of the kernel against its reference (fp32, on the kernel's own quantized rows:
    the MMA's accumulation within a block, FMA contraction, the bf16 output) and against the bf16 product on the
    dequantized weight (the e4m3 activations)."""
    q, q_scale = quantize_activation_rows_triton(x)
    ours = w8a8_matmul_triton(q, q_scale, wq[0], wq[1], plan).float()
    reference = w8a8_block_products_reference(q, q_scale, wq[0], wq[1], plan)
    dense = F.linear(x, dequantize_triton(wq[0], wq[1], x.dtype)).float()
    return dict(
        vs_reference=((ours - reference).norm() / reference.norm()).item(),
        vs_dequantized_bf16=((ours - dense).norm() / dense.norm()).item(),
    )


def table(preset: str, only: str, bandwidth: float) -> list[dict]:
    rows = []
    for name, (n, k) in fp8_shapes(preset).items():
        if only not in name:
            continue
        fp8, dense = rotated_weights(n, k)
        x_all = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        plan = gemm_plan_w8a8(n, k)
        fails = invariance_failures(w8a8(plan), x_all, fp8[0])
        err = errors(x_all[:128], fp8[0], plan)
        print(f"\n{name} {n}x{k}: W8A8 plan {plan}, rows invariant: {fails or 'yes'}, error vs reference "
              f"{err['vs_reference']:.1e}, vs dequantized bf16 {err['vs_dequantized_bf16']:.1e}")  # fmt: skip
        for m in DECODE_M:
            x = x_all[:m]
            q, q_scale = quantize_activation_rows_triton(x)
            row = dict(name=name, n=n, k=k, m=m, invariance_failures=fails, **err, plan=dataclasses.asdict(plan))
            row["w8a8_us"] = graph_us(w8a8(plan), x, fp8)
            gemm = functools.partial(w8a8_matmul_triton, q, q_scale, plan=plan)
            row["w8a8_gemm_us"] = graph_us(lambda _, wq, gemm=gemm: gemm(*wq), x, fp8)
            row["quantize_us"] = graph_us(lambda a, _: quantize_activation_rows_triton(a), x, [None])
            row["w8a16_us"] = graph_us(lambda a, wq: invariant_matmul_triton(a, wq[0], scale=wq[1]), x, fp8)
            row["bf16_ours_us"] = graph_us(lambda a, w: invariant_matmul_triton(a, w), x, dense)
            row["cublas_bf16_us"] = graph_us(F.linear, x, dense)
            moved = bytes_read(n, k, fp8[0], m)
            row["w8a8_pct_copy_bw"] = 100 * moved / (row["w8a8_us"] * 1e-6) / bandwidth
            row["w8a8_gemm_pct_copy_bw"] = 100 * moved / (row["w8a8_gemm_us"] * 1e-6) / bandwidth
            rows.append(row)
            print(f"  M={m:<4d} w8a8 {row['w8a8_us']:6.1f} us (gemm {row['w8a8_gemm_us']:6.1f}, quantize "
                  f"{row['quantize_us']:4.1f}; {row['w8a8_pct_copy_bw']:3.0f}% / {row['w8a8_gemm_pct_copy_bw']:3.0f}% "
                  f"copy bw)  w8a16 {row['w8a16_us']:6.1f}  bf16 ours {row['bf16_ours_us']:6.1f}  cuBLAS bf16 "
                  f"{row['cublas_bf16_us']:6.1f}  {row['w8a16_us'] / row['w8a8_us']:.2f}x w8a16")  # fmt: skip
        del fp8, dense
        torch.cuda.empty_cache()
    return rows


def w8a8_candidates(
    n: int, k: int, sms: int, keep_splits: bool = False, splits_asked: tuple[int, ...] = ()
) -> dict[str, GemmPlan]:
    """The plans timed for one shape: the current one, then each variant at its split choices (those of
    `gemm_family.split_choices`, which sizes stages as bf16: an upper bound here) and one split. `keep_splits`: at
    the current plan's K split only, so every candidate sums as the shape's row buckets do (`same_sums`) and can
    replace its `TUNED_W8A8` entry without a bucket re-tune. `splits_asked`: at each of these split counts instead
    (more splits fill the waves at one row, and write M x N partial sums per split at many: both are timed)."""
    current = gemm_plan_w8a8(n, k)
    plans = {"current": current}
    for name, tile in W8A8_VARIANTS.items():
        if keep_splits:
            choices = [current.splits(k)]
        else:
            choices = list(splits_asked) or sorted({1, *split_choices(tile, n, k, sms)})[:3]
        for splits in choices:
            plan = _with_splits(tile, k, splits)
            if keep_splits and plan.k_per_split != current.k_per_split:
                continue  # the split count does not give the current split points
            plans.setdefault(f"{name} s{plan.splits(k)}", plan)
    return plans


def _compile(task: tuple[int, int, GemmPlan]) -> str | None:
    """Worker: launch the plan once (compiling it into Triton's disk cache); the error, if any."""
    n, k, plan = task
    try:
        q, s = random_fp8(n, k, 0)
        linear_fp8_w8a8_triton(torch.zeros(1, k, device="cuda", dtype=torch.bfloat16), q, s, plan)
        torch.cuda.synchronize()
        return None
    except Exception as err:  # a plan the compiler cannot build (shared memory, registers)
        return _error(err)


def measure_family_shape(
    n: int, k: int, plans: dict[str, GemmPlan], bandwidth: float, choice_m: tuple[int, ...] = CHOICE_M
) -> dict:
    """Every W8A8 plan of one shape at `FAMILY_M` (quantization included), rows checked bitwise across M; the
    W8A16 plan in use, our bf16 plan and cuBLAS bf16 as baselines; the best: the lowest sum over `choice_m`."""
    fp8, dense = rotated_weights(n, k)
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    entry = dict(n=n, k=k)
    entry["cublas_us"] = {m: graph_us(F.linear, x[:m], dense) for m in FAMILY_M}
    bf16_plan = gemm_plan(n, k)
    entry["bf16_ours_us"] = {m: graph_us(lambda a, w: invariant_matmul_triton(a, w, bf16_plan), x[:m], dense)
                             for m in FAMILY_M}  # fmt: skip
    entry["w8a16_us"] = {m: graph_us(lambda a, wq: invariant_matmul_triton(a, wq[0], gemm_plan_fp8(n, k), scale=wq[1]),
                                     x[:m], fp8) for m in FAMILY_M}  # fmt: skip
    entry["roofline_us"] = {m: bytes_read(n, k, fp8[0], m) / bandwidth * 1e6 for m in FAMILY_M}
    results, skipped = {}, {}
    for label, plan in plans.items():
        fn = w8a8(plan)
        try:
            fails = invariance_failures(fn, x, fp8[0])
            us = {m: graph_us(fn, x[:m], fp8) for m in FAMILY_M}
        except Exception as err:  # a plan the compiler cannot build: reported, skipped
            skipped[label] = _error(err)
            continue
        results[label] = dict(plan=dataclasses.asdict(plan), splits=plan.splits(k), us=us, invariance_failures=fails)
    ok = [label for label, r in results.items() if not r["invariance_failures"]]
    best = min(ok, key=lambda label: sum(results[label]["us"][m] for m in choice_m)) if ok else None
    entry.update(plans=results, skipped=skipped, best=best)
    if best is not None:
        entry["best_errors"] = errors(x[:128], fp8[0], plans[best])
    del fp8, dense, x
    torch.cuda.empty_cache()
    return entry


def print_family_shape(name: str, e: dict) -> None:
    print(f"\n{name} {e['n']}x{e['k']} ({e['n'] * e['k'] / 1e6:.0f} MB e4m3): us per call", flush=True)
    print(f"  {'plan':22s} {'sp':>2s} " + " ".join(f"{'M=' + str(m):>7s}" for m in FAMILY_M) + "  invariant")
    baselines = (("roofline (copy bw)", "roofline_us"), ("cuBLAS bf16", "cublas_us"), ("ours bf16", "bf16_ours_us"),
                 ("w8a16 (in use)", "w8a16_us"))  # fmt: skip
    for label, key in baselines:
        print(f"  {label:22s} {'':>2s} " + " ".join(f"{e[key][m]:7.1f}" for m in FAMILY_M))
    for label, r in e["plans"].items():
        fails = r["invariance_failures"]
        cells = " ".join(f"{r['us'][m]:7.1f}" for m in FAMILY_M)
        inv = "yes" if not fails else "NO: " + ", ".join(fails[:4])
        print(f"{'*' if label == e['best'] else ' '} {label:22s} {r['splits']:2d} {cells}  {inv}")
    for label, err in e["skipped"].items():
        print(f"  {label:22s} skipped: {err}")


def family(
    preset: str,
    only: str,
    out_path: str | None,
    jobs: int,
    bandwidth: float,
    choice_m: tuple[int, ...] = CHOICE_M,
    keep_splits: bool = False,
    splits: tuple[int, ...] = (),
    draft_lm_head: bool = False,
) -> dict:
    props = torch.cuda.get_device_properties(0)
    t0 = time.time()
    sms = props.multi_processor_count
    shapes = named_once(family_shapes(preset, draft_lm_head), only).items()
    todo = {name: (nk, w8a8_candidates(*nk, sms, keep_splits, splits)) for name, nk in shapes}
    tasks = [(n, k, plan) for (n, k), plans in todo.values() for plan in plans.values()]
    errs = precompile(tasks, jobs, _compile)
    print(f"compiled {len(tasks)} plans in {time.time() - t0:.0f} s ({jobs} processes, {len(errs)} errors)")
    report = {}
    for name, ((n, k), plans) in todo.items():
        report[name] = measure_family_shape(n, k, plans, bandwidth, choice_m)
        print_family_shape(name, report[name])
    print("\nBest W8A8 plan per shape (lowest mean us over M = " + ", ".join(map(str, choice_m)) + ", quantization")
    print("included): x the W8A16 plan in use at each M; then TUNED_W8A8 entries for ops/linear.py")
    for name, e in report.items():
        if e["best"] is None:
            print(f"  {name:30s} no invariant plan")
            continue
        us = e["plans"][e["best"]]["us"]
        speed = " ".join(f"{e['w8a16_us'][m] / us[m]:4.2f}x" for m in FAMILY_M)
        print(f"  {name:30s} {e['best']:22s} {speed}  errors {e['best_errors']}")
    for name, e in report.items():
        if e["best"] is not None:
            p = GemmPlan(**e["plans"][e["best"]]["plan"])
            print(f"    # {preset} {name}: {e['best']}\n    ({e['n']}, {e['k']}): GemmPlan({p.block_n}, {p.block_k}, "
                  f"{p.k_per_split}, {p.num_warps}, {p.num_stages}, \"stream\", {p.block_m}, {p.row_tiles}, "
                  f"{p.swap_ab}),")  # fmt: skip
    print(f"{time.time() - t0:.0f} s in all")
    path = out_path or os.path.join(os.environ.get("OUT", "."), "gemm-w8a8-family.json")
    meta = dict(device=props.name, torch=torch.__version__, triton=triton.__version__, preset=preset, kind="w8a8",
                choice_m=list(choice_m), keep_splits=keep_splits, splits=list(splits))  # fmt: skip
    with open(path, "w") as f:
        json.dump(dict(meta, copy_bandwidth=bandwidth, shapes=report), f, indent=1)
    print(f"wrote {path}")
    return report


TILES_M = (1, 2, 4, 8, 16, 32)


def tiles_table(preset: str, only: str, bandwidth: float) -> list[dict]:
    """`--tiles`: the launch of M rows as the engine makes it (`row_plan`: the shape's row bucket, its TMA choice)
    with 16-row and with 32-row tiles (the MMA's N, swapped), each variant's rows checked bitwise across M and
    against the engine's product at M = 256."""
    rows = []
    for name, (n, k) in fp8_shapes(preset).items():
        if only not in name:
            continue
        fp8, _ = rotated_weights(n, k)
        x_all = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
        engine = linear_fp8_w8a8_triton(x_all, *fp8[0])
        print(f"\n{name} {n}x{k}: us per call (x 32-row tiles), bits equal to the engine's at M = 256, invariant")
        for m in TILES_M:
            plan = row_plan(n, k, m, True, W8A8_ROW_BUCKETS, gemm_plan_w8a8, TMA_LOAD_BUCKETS["w8a8"])
            row = dict(name=name, n=n, k=k, m=m, plan=dataclasses.asdict(plan), variants={})
            for rows_a_tile in (16, 32):
                fn = w8a8(replace(plan, block_m=rows_a_tile))
                us = graph_us(fn, x_all[:m], fp8)
                moved = bytes_read(n, k, fp8[0], m)
                row["variants"][f"{rows_a_tile}-row tiles"] = dict(
                    us=us, equal_at_256=torch.equal(fn(x_all, fp8[0]), engine),
                    invariance_failures=invariance_failures(fn, x_all, fp8[0]) if m == 1 else [],
                    pct_copy_bw=100 * moved / (us * 1e-6) / bandwidth,
                )  # fmt: skip
            base = row["variants"]["32-row tiles"]["us"]
            cells = "  ".join(f"{label} {v['us']:6.1f} ({v['us'] / base:4.2f}x, {v['pct_copy_bw']:3.0f}% copy bw"
                              f"{'' if v['equal_at_256'] else ', BITS'}"
                              f"{', NOT INVARIANT' if v['invariance_failures'] else ''})"
                              for label, v in row["variants"].items())  # fmt: skip
            print(f"  M={m:<3d} {cells}")
            rows.append(row)
        del fp8
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="qwen3.5-27b")
    parser.add_argument("only", nargs="?", default="", help="only the shapes whose name contains this")
    parser.add_argument("--family", action="store_true", help="time the W8A8 plan family")
    parser.add_argument("--tiles", action="store_true", help="the engine's launches with 16-row and 32-row tiles")
    parser.add_argument("--choice-m", default=",".join(map(str, CHOICE_M)),
                        help="--family: the row counts whose summed time picks the best plan (e.g. 1,8,16: the "
                        "shape's own plan serves M <= 16 where the row buckets start at 17)")  # fmt: skip
    parser.add_argument("--keep-splits", action="store_true",
                        help="--family: only candidates at the current plan's K split (the row buckets stay "
                        "valid)")  # fmt: skip
    parser.add_argument("--splits", default="", help="--family: every variant at these K split counts (e.g. "
                        "3,6,8,16; not with --keep-splits)")  # fmt: skip
    parser.add_argument("--draft-lm-head", action="store_true",
                        help="--family: time the FP8 copy of the lm_head the drafts score through instead")  # fmt: skip
    parser.add_argument("--out", help="JSON path (default: $OUT/gemm-w8a8.json, --family: $OUT/gemm-w8a8-family.json, "
                        "--tiles: $OUT/gemm-w8a8-tiles.json)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="--family: compile processes")
    args = parser.parse_args()
    splits = tuple(int(s) for s in args.splits.split(",") if s)
    if splits and args.keep_splits:
        parser.error("--splits and --keep-splits exclude each other")
    sys.stdout.reconfigure(line_buffering=True)  # a log that a timeout cuts still holds every finished line
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.family:
        choice_m = tuple(int(m) for m in args.choice_m.split(","))
        family(args.preset, args.only, args.out, args.jobs, bandwidth, choice_m, args.keep_splits, splits,
               args.draft_lm_head)  # fmt: skip
        return
    if args.tiles:
        rows = tiles_table(args.preset, args.only, bandwidth)
        path = args.out or os.path.join(os.environ.get("OUT", "."), "gemm-w8a8-tiles.json")
        with open(path, "w") as f:
            json.dump({"preset": args.preset, "copy_bandwidth": bandwidth, "rows": rows}, f, indent=1)
        print(f"wrote {path}")
        return
    rows = table(args.preset, args.only, bandwidth)
    path = args.out or os.path.join(os.environ.get("OUT", "."), "gemm-w8a8.json")
    with open(path, "w") as f:
        json.dump({"preset": args.preset, "copy_bandwidth": bandwidth, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
