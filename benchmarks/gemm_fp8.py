"""FP8 block GEMMs on the GPU at a preset's FP8 shapes (the projections Qwen's FP8 releases quantize, fused as
the model holds them): our W8A16 kernel (ops/linear.py, `TUNED_FP8` plans) against our bf16 kernel and cuBLAS
bf16 at M = 1 .. 128, with the bitwise invariance of W8A16 rows across M checked in the same run and the percent
of the copy bandwidth (bytes read: e4m3 weight + fp32 scales + bf16 activations and output); then the prefill
candidates at M = 512 .. 8192 (`FP8_PREFILL`: scaled_mm with the fused activation quantization, dequantize +
cuBLAS, w8a16; cuBLAS bf16 and, when torchao imports, its blockwise Triton GEMM with its activation quantization
for reference), with the fastest method per shape. The JSON report goes to --out (default: $OUT/gemm_fp8.json).
`--family` instead times the W8A16 plan family per shape (`fp8_candidates`: the current plan and each of
`FP8_VARIANTS` at its K splits, M = 1 .. 128 under CUDA graphs, rows checked bitwise across M, the best plan
checked against our bf16 kernel on the dequantized weight) into $OUT/gemm-fp8-family.json, which
`benchmarks/apply_plans.py --fp8` writes into `TUNED_FP8` (27B: about 2-3 minutes on an H200).
Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/gemm_fp8.py [qwen3.5-27b] [name filter] [--family]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from qwen_mtp.bench import copy_bandwidth
from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.ops.linear import (
    GemmPlan,
    dequantize_triton,
    gemm_plan,
    gemm_plan_fp8,
    invariant_matmul_triton,
    scaled_mm_linear,
    scaled_mm_supported,
)
from qwen_mtp.testing.synthetic import synthetic_config

DECODE_M = (1, 2, 4, 8, 16, 32, 64, 96, 128)
PREFILL_M = (512, 2048, 8192)
ROTATE_BYTES = 256 << 20  # weights rotated past the 60 MB L2


def fp8_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each FP8 weight the model holds: in_proj_b/a stay bf16, so the GDN's FP8 part is qkv + z."""
    c = synthetic_config(preset)
    s = RankShapes.of(c)
    h, inter = c.hidden_size, c.intermediate_size
    attn_q, attn_kv = 2 * c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "gdn in_proj qkv+z": (s.gdn_conv_dim + s.gdn_value_dim, h), "gdn out_proj": (h, s.gdn_value_dim),
        "attn qkv": (attn_q + 2 * attn_kv, h), "attn o_proj": (h, c.num_attention_heads * c.head_dim),
        "mlp gate_up": (2 * inter, h), "mlp down": (h, inter),
    }  # fmt: skip


def timed(fn, x: torch.Tensor, weights: list) -> float:
    """Microseconds per call, weights rotated so that L2 never holds the next one."""
    rotation = itertools.cycle(weights)
    return triton.testing.do_bench(lambda: fn(x, next(rotation)), warmup=5, rep=25) * 1e3


def weights_for(n: int, k: int):
    """Enough weight copies to rotate past L2: e4m3 with bf16-valued block scales, and their dequantized bf16."""
    copies = max(2, ROTATE_BYTES // (n * k))
    fp8 = [random_fp8(n, k, seed) for seed in range(copies)]
    dense = [dequantize_triton(q, s, torch.bfloat16) for q, s in fp8[: max(2, copies // 2)]]
    return dense, fp8


def w8a16(plan=None):
    return lambda x, wq: invariant_matmul_triton(x, wq[0], plan, scale=wq[1])


def invariant_rows(fn, x: torch.Tensor, w) -> bool:
    full = fn(x, w)
    return all(torch.equal(fn(x[:m], w), full[:m]) for m in (1, 2, 16, 17, 64, x.shape[0] - 1))


def torchao_blockwise():
    """torchao's 1x128/128x128 Triton GEMM with its activation quantization, or None when torchao is absent."""
    try:
        from torchao.kernel.blockwise_quantization import blockwise_fp8_gemm, fp8_blockwise_act_quant
    except ImportError:
        return None

    def run(x, wq):
        q, s = fp8_blockwise_act_quant(x, 128)
        return blockwise_fp8_gemm(q, s, wq[0], wq[1], 128)

    return run


def table(preset: str, only: str, bandwidth: float) -> list[dict]:
    rows, tao = [], torchao_blockwise()
    for name, (n, k) in fp8_shapes(preset).items():
        if only not in name:
            continue
        dense, fp8 = weights_for(n, k)
        x_all = torch.randn(max(PREFILL_M), k, device="cuda", dtype=torch.bfloat16)
        invariant = invariant_rows(w8a16(), x_all[:256], fp8[0])
        scale_bytes = fp8[0][1].numel() * 4
        for m in DECODE_M + PREFILL_M:
            x = x_all[:m]
            row = dict(name=name, n=n, k=k, m=m, invariant=invariant, plan=dataclasses.asdict(gemm_plan_fp8(n, k)))
            row["w8a16_us"] = timed(w8a16(), x, fp8)
            row["bf16_ours_us"] = timed(lambda x, w: invariant_matmul_triton(x, w), x, dense)
            row["cublas_bf16_us"] = timed(F.linear, x, dense)
            moved = n * k + scale_bytes + 2 * m * (n + k)
            row["w8a16_pct_copy_bw"] = 100 * moved / (row["w8a16_us"] * 1e-6) / bandwidth
            row["speedup_vs_bf16_ours"] = row["bf16_ours_us"] / row["w8a16_us"]
            if m in PREFILL_M:
                if scaled_mm_supported(x, fp8[0][0]):
                    row["scaled_mm_us"] = timed(lambda x, wq: scaled_mm_linear(x, wq[0], wq[1]), x, fp8)
                row["dequantize_cublas_us"] = timed(lambda x, wq: F.linear(x, dequantize_triton(*wq, x.dtype)), x, fp8)
                if tao is not None:
                    try:
                        row["torchao_blockwise_us"] = timed(tao, x, fp8)
                    except Exception as err:  # noqa: BLE001 (report, keep measuring)
                        row["torchao_error"] = f"{type(err).__name__}: {err}"[:200]
                methods = {"scaled_mm": "scaled_mm_us", "dequantize": "dequantize_cublas_us", "w8a16": "w8a16_us"}
                row["fastest_prefill"] = min((row[key], method) for method, key in methods.items() if key in row)[1]
            rows.append(row)
            others = ("scaled_mm_us", "dequantize_cublas_us", "torchao_blockwise_us")
            extra = "".join(f" {key[:-3]} {row[key]:7.1f}" for key in others if key in row)
            print(f"{name:18s} {n:6d}x{k:<6d} M={m:<5d} w8a16 {row['w8a16_us']:7.1f} us "
                  f"({row['w8a16_pct_copy_bw']:3.0f}% copy bw, {row['speedup_vs_bf16_ours']:.2f}x our bf16)  "
                  f"bf16 ours {row['bf16_ours_us']:7.1f}  cuBLAS {row['cublas_bf16_us']:7.1f}{extra}"
                  f"{'' if invariant else '  NOT INVARIANT'}", flush=True)  # fmt: skip
        del dense, fp8
        torch.cuda.empty_cache()
    return rows


# The W8A16 plan family: name -> tile shape (K split chosen per weight shape by `gemm_family.split_choices`). An
# e4m3 weight tile is half a bf16 one, so the activation tiles (bf16, every stage holds row_tiles x block_m rows)
# take a larger share of shared memory: the fp8 variants trade row tiles for pipeline stages (bytes in flight).
#  f: 128x128 weight tiles, 8 warps, swapped (the weight is wgmma's 64-row side); swap32x4 is the bf16 winner.
#  e: 64x128 tiles, one warpgroup: twice the programs (fuller last wave on wide shapes).
#  g: 256-deep K blocks (half the loop trips; 16-byte copies of e4m3).
#  d: 64-row column side, two tiles: 128 rows per weight pass (large M).
#  b: unswapped 16-row mma.sync tiles on 32-wide weight slices (the old grid plans' shape, streamed).
FP8_VARIANTS: dict[str, GemmPlan] = {
    "f swap32x4": GemmPlan(128, 128, 1, 8, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    "f swap16x4 s4": GemmPlan(128, 128, 1, 8, 4, family="stream", block_m=16, row_tiles=4, swap_ab=True),
    "f swap16x2 s6": GemmPlan(128, 128, 1, 8, 6, family="stream", block_m=16, row_tiles=2, swap_ab=True),
    "f swap32x2 s5": GemmPlan(128, 128, 1, 8, 5, family="stream", block_m=32, row_tiles=2, swap_ab=True),
    "e swap32x4": GemmPlan(64, 128, 1, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    "e swap16x4 s6": GemmPlan(64, 128, 1, 4, 6, family="stream", block_m=16, row_tiles=4, swap_ab=True),
    "e swap16x2 s8": GemmPlan(64, 128, 1, 4, 8, family="stream", block_m=16, row_tiles=2, swap_ab=True),
    "g swap16x2 k256": GemmPlan(64, 256, 1, 4, 4, family="stream", block_m=16, row_tiles=2, swap_ab=True),
    "g swap16x2 k256 w8": GemmPlan(128, 256, 1, 8, 4, family="stream", block_m=16, row_tiles=2, swap_ab=True),
    "d swap64x2": GemmPlan(128, 128, 1, 8, 3, family="stream", block_m=64, row_tiles=2, swap_ab=True),
    "b 16x4 n32": GemmPlan(32, 128, 1, 4, 4, family="stream", block_m=16, row_tiles=4),
}
FAMILY_M = (1, 8, 16, 32, 64, 128)
CHOICE_M = (1, 8, 16, 32, 64)  # the decode / verify row counts the plan is chosen for


def fp8_candidates(n: int, k: int, sms: int) -> dict[str, GemmPlan]:
    """The plans timed for one fp8 weight shape: the current one (`gemm_plan_fp8`), then each variant at its
    split choices."""
    from gemm_family import _with_splits, split_choices

    plans = {"current": gemm_plan_fp8(n, k)}
    for name, tile in FP8_VARIANTS.items():
        for splits in split_choices(tile, n, k, sms)[:2]:
            plan = _with_splits(tile, k, splits)
            plans.setdefault(f"{name} s{plan.splits(k)}", plan)
    return plans


def random_fp8(n: int, k: int, seed: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [N, K] (values over the whole e4m3 range, subnormals included) and fp32 block scales
    holding bf16 values (as Qwen's releases store them), without torchao (not on the GPU box)."""
    g = torch.Generator(device).manual_seed(seed)
    q = (torch.randn(n, k, device=device, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-n // 128), -(-k // 128))
    scale = (torch.rand(grid, device=device, generator=g) * 4e-4 + 1e-5).to(torch.bfloat16).float()
    return q, scale


def best_fp8_plan(results: dict[str, dict]) -> str | None:
    """The plan whose rows never depend on M with the lowest mean time over `CHOICE_M` (every decode row count
    counts alike: the time of a step is what it reads, whatever the batch)."""
    ok = [label for label, r in results.items() if not r["invariance_failures"]]
    return min(ok, key=lambda label: sum(results[label]["us"][m] for m in CHOICE_M)) if ok else None


_WORKER_WEIGHTS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _compile(task: tuple[int, int, GemmPlan, bool]) -> str | None:
    """Worker: launch the plan once on an fp8 weight (W8A16) or on its bf16 dequantization (compiling it into
    Triton's disk cache); the error, if any."""
    from gemm_family import _error

    n, k, plan, fp8 = task
    try:
        wq = _WORKER_WEIGHTS.get((n, k))
        if wq is None:
            wq = _WORKER_WEIGHTS[n, k] = random_fp8(n, k, 0)
        x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
        if fp8:
            invariant_matmul_triton(x, wq[0], plan, scale=wq[1])
        else:
            invariant_matmul_triton(x, dequantize_triton(*wq, torch.bfloat16), plan)
        torch.cuda.synchronize()
        return None
    except Exception as err:  # a plan the compiler cannot build (shared memory, registers)
        return _error(err)


def measure_family_shape(n: int, k: int, plans: dict[str, GemmPlan], bandwidth: float) -> dict:
    """Every W8A16 plan of one shape at `FAMILY_M` (graph replay, weights rotated past L2), with its rows checked
    bitwise across M; cuBLAS bf16 and our bf16 plan on the dequantized weight as the baselines; the best plan's
    rows against our bf16 kernel on the dequantized weight with the same plan (bitwise: the dequantization is
    transformers') and against cuBLAS (max abs difference)."""
    from gemm_family import _error, graph_us, invariance_failures

    copies = max(2, -(-ROTATE_BYTES // (n * k)))
    fp8 = [random_fp8(n, k, seed) for seed in range(copies)]
    dense = [dequantize_triton(q, s, torch.bfloat16) for q, s in fp8[: max(1, copies // 2)]]
    x = torch.randn(256, k, device=fp8[0][0].device, dtype=torch.bfloat16)
    entry = dict(n=n, k=k, cublas_us={m: graph_us(F.linear, x[:m], dense) for m in FAMILY_M})
    bf16_plan = gemm_plan(n, k)
    entry["bf16_ours_us"] = {m: graph_us(lambda a, w: invariant_matmul_triton(a, w, bf16_plan), x[:m], dense)
                             for m in FAMILY_M}  # fmt: skip
    entry["roofline_us"] = {m: (n * k + 4 * fp8[0][1].numel() + 2 * m * (n + k)) / bandwidth * 1e6 for m in FAMILY_M}
    results, skipped = {}, {}
    for label, plan in plans.items():
        fn = w8a16(plan)
        try:
            fails = invariance_failures(fn, x, fp8[0])
            us = {m: graph_us(fn, x[:m], fp8) for m in FAMILY_M}
        except Exception as err:  # a plan the compiler cannot build: reported, skipped
            skipped[label] = _error(err)
            continue
        results[label] = dict(plan=dataclasses.asdict(plan), splits=plan.splits(k), us=us, invariance_failures=fails)
    entry.update(plans=results, skipped=skipped, best=best_fp8_plan(results))
    if entry["best"] is not None:
        plan, (q, s) = plans[entry["best"]], fp8[0]
        ours = invariant_matmul_triton(x, q, plan, scale=s)
        deq = dequantize_triton(q, s, torch.bfloat16)
        entry["best_equals_bf16_kernel_on_dequantized"] = torch.equal(ours, invariant_matmul_triton(x, deq, plan))
        entry["best_max_abs_diff_vs_cublas"] = (ours.float() - F.linear(x, deq).float()).abs().max().item()
    del fp8, dense, x
    torch.cuda.empty_cache()
    return entry


def print_family_shape(name: str, e: dict) -> None:
    print(f"\n{name} {e['n']}x{e['k']} ({e['n'] * e['k'] / 1e6:.0f} MB e4m3): us per call", flush=True)
    print(f"  {'plan':22s} {'sp':>2s} " + " ".join(f"{'M=' + str(m):>7s}" for m in FAMILY_M) + "  invariant")
    baselines = (("roofline (copy bw)", "roofline_us"), ("cuBLAS bf16", "cublas_us"), ("ours bf16", "bf16_ours_us"))
    for label, key in baselines:
        print(f"  {label:22s} {'':>2s} " + " ".join(f"{e[key][m]:7.1f}" for m in FAMILY_M))
    for label, r in e["plans"].items():
        fails = r["invariance_failures"]
        cells = " ".join(f"{r['us'][m]:7.1f}" for m in FAMILY_M)
        inv = "yes" if not fails else "NO: " + ", ".join(fails[:4])
        print(f"{'*' if label == e['best'] else ' '} {label:22s} {r['splits']:2d} {cells}  {inv}")
    for label, err in e["skipped"].items():
        print(f"  {label:22s} skipped: {err}")


def family(preset: str, only: str, out_path: str | None, jobs: int, bandwidth: float) -> dict:
    """The W8A16 family sweep: every FP8 shape of the preset, `fp8_candidates` each; returns the report that
    `apply_plans.py --fp8` turns into `TUNED_FP8`."""
    props = torch.cuda.get_device_properties(0)
    t0 = time.time()
    from gemm_family import named_once, precompile

    sms = props.multi_processor_count
    todo = {name: (nk, fp8_candidates(*nk, sms)) for name, nk in named_once(fp8_shapes(preset), only).items()}
    tasks = [(n, k, plan, True) for (n, k), plans in todo.values() for plan in plans.values()]
    tasks += [(n, k, gemm_plan(n, k), False) for (n, k), _ in todo.values()]  # the bf16 baseline
    errors = precompile(tasks, jobs, _compile)
    print(f"compiled {len(tasks)} plans in {time.time() - t0:.0f} s ({jobs} processes, {len(errors)} errors)")
    report = {}
    for name, ((n, k), plans) in todo.items():
        report[name] = measure_family_shape(n, k, plans, bandwidth)
        print_family_shape(name, report[name])
    print("\nBest W8A16 plan per shape (lowest mean us over M = " + ", ".join(map(str, CHOICE_M)) + "): % of the copy")
    print("bandwidth at each M, x our bf16 plan, bitwise equal to our bf16 kernel on the dequantized weight")
    for name, e in report.items():
        if e["best"] is None:
            print(f"  {name:30s} no invariant plan")
            continue
        us = e["plans"][e["best"]]["us"]
        pct = " ".join(f"{100 * e['roofline_us'][m] / us[m]:4.0f}%" for m in FAMILY_M)
        speed = " ".join(f"{e['bf16_ours_us'][m] / us[m]:4.2f}x" for m in FAMILY_M)
        print(f"  {name:30s} {e['best']:22s} {pct}  {speed}  {e['best_equals_bf16_kernel_on_dequantized']}")
    print(f"{time.time() - t0:.0f} s in all")
    path = out_path or os.path.join(os.environ.get("OUT", "."), "gemm-fp8-family.json")
    meta = dict(device=props.name, torch=torch.__version__, triton=triton.__version__, preset=preset, kind="fp8")
    with open(path, "w") as f:
        json.dump(dict(meta, copy_bandwidth=bandwidth, shapes=report), f, indent=1)
    print(f"wrote {path}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="qwen3.5-27b")
    parser.add_argument("only", nargs="?", default="", help="only the shapes whose name contains this")
    parser.add_argument("--family", action="store_true", help="time the W8A16 plan family (report for apply_plans)")
    parser.add_argument("--out", help="JSON path (default: $OUT/gemm_fp8.json, --family: $OUT/gemm-fp8-family.json)")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="--family: compile processes")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    if args.family:
        family(args.preset, args.only, args.out, args.jobs, bandwidth)
        return
    rows = table(args.preset, args.only, bandwidth)
    path = args.out or os.path.join(os.environ.get("OUT", "."), "gemm_fp8.json")
    with open(path, "w") as f:
        json.dump({"preset": args.preset, "copy_bandwidth": bandwidth, "rows": rows}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
