"""Tune the batch-invariant GEMM (ops/linear.py) per decode weight shape on the GPU: tries every plan
(BLOCK_N, BLOCK_K, K splits, pipeline stages), checks each is still batch-invariant (M = 1 rows equal the
M = 16 rows bitwise), and prints the fastest per shape for M = 1 and M = 8, against the current plan and
cuBLAS, plus a `TUNED` table to paste into ops/linear.py. Writes gemm_sweep.json to $OUT or cwd.
`--family`: instead, every kernel variant against cuBLAS at M = 1 .. 256 and prefill sizes, with a bitwise
invariance check across M, lm_head included (benchmarks/gemm_family.py; about 2-3 minutes on an H200).
Usage (GPU box): python3 benchmarks/gemm_sweep.py [qwen3.5-27b] [name filter, e.g. fused] [--family] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.ops.linear import GemmPlan, gemm_plan, invariant_matmul_triton
from qwen_mtp.testing.synthetic import synthetic_config


def decode_shapes(preset: str, lm_head: bool = False) -> dict[str, tuple[int, int]]:
    """(N, K) of every decode-path linear of a synthetic preset's config, as the CUDA engine runs them (input
    projections fused, as the model's `MergedLinear`s hold them); `lm_head` adds it (the plan search leaves it out:
    it is wide enough for any plan, and 2.5 GB per copy at 27B)."""
    c = synthetic_config(preset)
    s = RankShapes.of(c)
    h, inter = c.hidden_size, c.intermediate_size
    attn_q, attn_kv = 2 * c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "gdn in_proj (fused)": (s.gdn_conv_dim + s.gdn_value_dim + 2 * s.gdn_value_heads, h),
        "gdn out_proj": (h, s.gdn_value_dim),
        "attn qkv (fused)": (attn_q + 2 * attn_kv, h), "attn o_proj": (h, c.num_attention_heads * c.head_dim),
        "mlp gate_up (fused)": (2 * inter, h), "mlp down": (h, inter), "mtp fc": (h, 2 * h),
        # the draft step's lm_head over a pruned draft vocabulary (mtp.draft_vocab, docs/mtp.md)
        "draft vocab 32k": (32768, h), "draft vocab 64k": (65536, h),
    } | ({"lm_head": (c.vocab_size, h)} if lm_head else {})  # fmt: skip


def timed(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per call, weights rotated so that L2 never holds the next one."""
    rotation = itertools.cycle(weights)
    return triton.testing.do_bench(lambda: fn(x, next(rotation)), warmup=5, rep=25) * 1e3


def plans(n: int, k: int):
    for block_n, block_k, stages in itertools.product((16, 32, 64), (128, 256), (3, 4)):
        k_blocks = -(-k // block_k)
        seen = set()
        for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 40):
            per = -(-k_blocks // min(splits, k_blocks))
            if per not in seen:
                seen.add(per)
                yield GemmPlan(block_n, block_k, per, 4, stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="qwen3.5-27b")
    parser.add_argument("only", nargs="?", default="", help="only the shapes whose name contains this")
    parser.add_argument("--family", action="store_true", help="time the kernel variants at M = 1 .. 8192 instead")
    parser.add_argument("--out", help="JSON path (default: $OUT or cwd)")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="--family: compile processes")
    parser.add_argument("--splits", default="", help="--family: time every variant at these K split counts (e.g. "
                        "3,6,8,16) instead of the ones the sweep picks per tile")  # fmt: skip
    args = parser.parse_args()
    if args.family:
        import gemm_family

        splits = tuple(int(s) for s in args.splits.split(",") if s)
        gemm_family.run(args.preset, args.only, args.out, args.jobs, splits)
        return
    preset, only = args.preset, args.only
    torch.manual_seed(0)
    report, tuned = [], {}
    for name, (n, k) in decode_shapes(preset).items():
        if (n, k) in tuned or only not in name:
            continue
        copies = max(1, (256 << 20) // (n * k * 2))  # rotate weights beyond L2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 8, 16)}

        results = []
        for plan in plans(n, k):
            try:
                full = invariant_matmul_triton(xs[16], ws[0], plan)
                if not torch.equal(invariant_matmul_triton(xs[16][:1], ws[0], plan), full[:1]):
                    continue
                t1 = timed(lambda x, w, p=plan: invariant_matmul_triton(x, w, p), xs[1], ws)
                t8 = timed(lambda x, w, p=plan: invariant_matmul_triton(x, w, p), xs[8], ws)
            except Exception as err:  # a plan the compiler cannot build (shared memory): skip it
                print(f"  skip {plan}: {type(err).__name__}", file=sys.stderr)
                continue
            results.append((t1 + t8, t1, t8, plan))
        results.sort(key=lambda r: r[0])
        _, b1, b8, best = results[0]
        current = gemm_plan(n, k)
        c1 = timed(lambda x, w, p=current: invariant_matmul_triton(x, w, p), xs[1], ws)
        cublas = timed(F.linear, xs[1], ws)
        gbs = n * k * 2 / b1 / 1e3
        print(f"{name:20s} {n:6d}x{k:<6d} best M=1 {b1:6.1f} us ({gbs:5.0f} GB/s) M=8 {b8:6.1f} us  "
              f"current M=1 {c1:6.1f} us  cuBLAS M=1 {cublas:6.1f} us  {best}")  # fmt: skip
        tuned[(n, k)] = best
        report.append(dict(name=name, n=n, k=k, best_m1_us=b1, best_m8_us=b8, current_m1_us=c1, cublas_m1_us=cublas,
                           plan=best.__dict__))  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    print("TUNED = {")
    for (n, k), p in tuned.items():
        print(f"    ({n}, {k}): GemmPlan({p.block_n}, {p.block_k}, {p.k_per_split}, {p.num_warps}, {p.num_stages}),")
    print("}")
    with open(args.out or os.path.join(os.environ.get("OUT", "."), "gemm_sweep.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
