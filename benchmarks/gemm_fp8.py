"""FP8 block GEMMs on the GPU at a preset's FP8 shapes (the projections Qwen's FP8 releases quantize, fused as
the model holds them): our W8A16 kernel (ops/linear.py, `TUNED_FP8` plans) against our bf16 kernel and cuBLAS
bf16 at M = 1 .. 128, with the bitwise invariance of W8A16 rows across M checked in the same run and the percent
of the copy bandwidth (bytes read: e4m3 weight + fp32 scales + bf16 activations and output); then the prefill
candidates at M = 512 .. 8192 (`FP8_PREFILL`: scaled_mm with the fused activation quantization, dequantize +
cuBLAS, w8a16; cuBLAS bf16 and, when torchao imports, its blockwise Triton GEMM with its activation quantization
for reference), with the fastest method per shape. `--sweep` instead searches W8A16 plans of both families per
shape (fastest at M = 1 and 16 among plans whose rows are bitwise equal across M) and prints a `TUNED_FP8`
table to paste into ops/linear.py. The JSON report goes to --out (default: $OUT/gemm_fp8.json or cwd).
Usage (GPU box): python3 benchmarks/gemm_fp8.py [qwen3.5-27b] [name filter] [--sweep] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

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
from qwen_mtp.quant.fp8 import quantize_fp8_block
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
    copies = max(2, ROTATE_BYTES // (n * k))
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, copies // 2))]
    fp8 = [quantize_fp8_block(w) for w in dense] + [quantize_fp8_block(w * 1.5) for w in dense]
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


def candidate_plans(n: int, k: int):
    """About 120 plans a shape (~2 minutes on an H200): filter by shape name to stay within a call's limit."""
    for block_n, block_k, stages in itertools.product((32, 64, 128), (128, 256, 512), (3,)):
        k_blocks = -(-k // block_k)
        seen = set()
        for splits in (1, 2, 4, 8, 16):
            per = -(-k_blocks // min(splits, k_blocks))
            if per in seen:
                continue
            seen.add(per)
            yield GemmPlan(block_n, block_k, per, 4, stages)
            yield GemmPlan(block_n, block_k, per, 4, stages, family="stream", row_tiles=2)
            if block_n >= 64:
                yield GemmPlan(block_n, block_k, per, 4, stages, family="stream", row_tiles=2, swap_ab=True)


def sweep(preset: str, only: str) -> list[dict]:
    report, tuned = [], {}
    for name, (n, k) in fp8_shapes(preset).items():
        if (n, k) in tuned or only not in name:
            continue
        _, fp8 = weights_for(n, k)
        x = torch.randn(65, k, device="cuda", dtype=torch.bfloat16)
        results = []
        for plan in candidate_plans(n, k):
            try:
                if not invariant_rows(w8a16(plan), x, fp8[0]):
                    continue
                t1, t16 = timed(w8a16(plan), x[:1], fp8), timed(w8a16(plan), x[:16], fp8)
            except Exception as err:  # noqa: BLE001 (a plan the compiler cannot build: skip it)
                print(f"  skip {plan}: {type(err).__name__}", file=sys.stderr)
                continue
            results.append((t1 + t16, t1, t16, plan))
        results.sort(key=lambda r: r[0])
        _, b1, b16, best = results[0]
        c1 = timed(w8a16(gemm_plan_fp8(n, k)), x[:1], fp8)
        print(f"{name:18s} {n:6d}x{k:<6d} best M=1 {b1:6.1f} us M=16 {b16:6.1f} us  current M=1 {c1:6.1f}  "
              f"(bf16 plan {gemm_plan(n, k)})  {best}", flush=True)  # fmt: skip
        tuned[(n, k)] = best
        report.append(dict(name=name, n=n, k=k, best_m1_us=b1, best_m16_us=b16, current_m1_us=c1,
                           plan=dataclasses.asdict(best)))  # fmt: skip
        del fp8
        torch.cuda.empty_cache()
    print("TUNED_FP8: dict[tuple[int, int], GemmPlan] = {")
    for (n, k), p in tuned.items():
        fields = ", ".join(f"{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p))
        print(f"    ({n}, {k}): GemmPlan({fields}),")
    print("}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="qwen3.5-27b")
    parser.add_argument("only", nargs="?", default="", help="only the shapes whose name contains this")
    parser.add_argument("--sweep", action="store_true", help="search W8A16 plans and print TUNED_FP8")
    parser.add_argument("--out", help="JSON path (default: $OUT/gemm_fp8.json or cwd)")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = sweep(args.preset, args.only) if args.sweep else table(args.preset, args.only, bandwidth)
    path = args.out or os.path.join(os.environ.get("OUT", "."), "gemm_fp8.json")
    with open(path, "w") as f:
        json.dump({"preset": args.preset, "copy_bandwidth": bandwidth, "rows": rows}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
