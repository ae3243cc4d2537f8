"""The batch-invariant GEMM at prefill row counts (issue #13 item 2, issue #20): candidate plans against cuBLAS.

A packed prefill (mixed steps) runs its linears through the invariant GEMM with the prefill plans
(`ops.linear.prefill_gemm_plan`). For every prefill weight shape of a preset (27B by default) and M in --rows this
times cuBLAS (`F.linear`), the plan packed prefills run now, and the candidates of `candidates()` (the "grid"
kernel's tilings and the "tma" kernel's), each under a CUDA graph; and checks bits in the same run:
- invariance: every candidate's rows at M = 1, 129 and the smallest --rows equal the same rows of the largest M;
- sums: whether a candidate's output equals the current prefill plan's bit for bit (`same_sums` says it should:
  one K split, wgmma, whatever the tiles).
Then one forward's linears summed (each shape times its count of modules): cuBLAS, the "grid" plan
(`grid_prefill_plan`), the best candidate per shape. `--apply` writes the best invariant candidate per shape into
`PREFILL_TUNED` (ops/linear.py), or the row-bucketed plans (`pick_prefill_buckets`: the fastest plan per
measured M, all summing alike) into `PREFILL_TUNED` and `PREFILL_ROW_BUCKETS` where the engine's dispatch of them
(plan from M) kept every row's bits across the bucket edges in the same run.

Usage (H200): python3 benchmarks/gemm_prefill.py [--preset qwen3.5-27b] [--rows 512,1024,2048,4096,8192]
[--out report.json] [--apply]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
from apply_plans import plan_text, table_pattern
from gemm_buckets import write_buckets
from gemm_family import _error, graph_us
from gemm_sweep import decode_shapes

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import GemmPlan, invariant_matmul_triton, prefill_gemm_plan, same_sums
from qwen_mtp.testing.synthetic import synthetic_config

DECODER_MODULES = ("gdn in_proj", "gdn out_proj", "attn qkv", "attn o_proj", "mlp gate_up", "mlp down")


def decoder_shape_counts(preset: str, shapes: dict[str, tuple[int, int]]) -> dict[tuple[int, int], int]:
    """(N, K) -> how many modules of that shape one prefill forward's decoder layers run, from a table of named
    shapes whose names start with their module's (`DECODER_MODULES`; others, such as the lm_head, which sees the
    last row of a prompt, or the MTP layer's, are left out): a GDN module once per GDN layer, an attention module
    once per attention layer, an MLP module once per layer."""
    c = synthetic_config(preset)
    gdn = sum(t == "gdn" for t in c.layer_types)
    layers = {"gdn": gdn, "attn": len(c.layer_types) - gdn, "mlp": len(c.layer_types)}
    counts: dict[tuple[int, int], int] = {}
    for name, shape in shapes.items():
        if any(name.startswith(module) for module in DECODER_MODULES):
            counts[shape] = counts.get(shape, 0) + layers[name.split()[0]]
    return counts


def prefill_shapes(preset: str) -> dict[tuple[int, int], int]:
    """(N, K) -> how many bf16 modules of that shape one prefill forward runs (`decoder_shape_counts`)."""
    return decoder_shape_counts(preset, decode_shapes(preset))


def candidates(n: int, k: int) -> dict[str, GemmPlan]:
    """Invariant plans for prefill row counts: one K split each (a function of (N, K) only, like every plan)."""
    one = lambda block_k: -(-k // block_k)  # noqa: E731  K blocks: the whole K loop in one split
    return {
        "grid128x128": linear.grid_prefill_plan(n, k),
        "tma128x128s4": GemmPlan(128, 64, one(64), 8, 4, "tma", 128),
        "tma128x256s3": GemmPlan(256, 64, one(64), 8, 3, "tma", 128),
        "tma128x256s3p": GemmPlan(256, 64, one(64), 8, 3, "tma", 128, persistent=True),
        "tma128x128s4p": GemmPlan(128, 64, one(64), 8, 4, "tma", 128, persistent=True),
        "tma128x128k128s3": GemmPlan(128, 128, one(128), 8, 3, "tma", 128),
        "tma256x128s3": GemmPlan(128, 64, one(64), 8, 3, "tma", 256),
        "tma64x256s4w4": GemmPlan(256, 64, one(64), 4, 4, "tma", 64),
        "tma128x256s3g16": GemmPlan(256, 64, one(64), 8, 3, "tma", 128, group_m=16),
        # smaller tiles, for few rows on the N = 5120 shapes (80-160 of the large tiles for 132 SMs at M = 512)
        "tma64x128s4w4": GemmPlan(128, 64, one(64), 4, 4, "tma", 64),
        "tma64x128s4w4p": GemmPlan(128, 64, one(64), 4, 4, "tma", 64, persistent=True),
        "tma128x64s4w4": GemmPlan(64, 64, one(64), 4, 4, "tma", 128),
        "tma64x256s3w8": GemmPlan(256, 64, one(64), 8, 3, "tma", 64),
    }


BUCKET_GAIN = 0.03  # a row bucket only where its plan beats the one before it by more than this, at a measured M
DISPATCH_CHECK_M = (1, 129, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4096)


def pick_prefill_buckets(entry: dict, rows: list[int]) -> tuple[str | None, tuple[tuple[int, str], ...]]:
    """The plans a shape's prefill launches run by row count, from a sweep entry: the fastest plan at the fewest
    measured rows, then a bucket from each larger measured M where another plan is faster than the one before it
    by more than BUCKET_GAIN (its first row: the geometric middle of that M and the one below it, a multiple of
    64). Only plans that are invariant and equal the current prefill plan bit for bit (so every bucket sums alike)."""
    ok = {a: b for a, b in entry["plans"].items() if b.get("invariant") and b.get("equals_current")}
    if not ok:
        return None, ()
    rows = sorted(rows)
    base = current = min(ok, key=lambda a: ok[a]["us"][rows[0]])
    buckets = []
    for below, m in zip(rows, rows[1:], strict=False):
        best = min(ok, key=lambda a, m=m: ok[a]["us"][m])
        if best != current and ok[best]["us"][m] < (1 - BUCKET_GAIN) * ok[current]["us"][m]:
            buckets.append((max(64, round((below * m) ** 0.5 / 64) * 64), best))
            current = best
    return base, tuple(buckets)


def engine_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The invariant linear as a prefill step calls it (the op: inside `prefill_rows` its plan comes from M)."""
    return linear.linear_op(x, weight, True)


def dispatch(n: int, k: int, base: GemmPlan, buckets: tuple[tuple[int, GemmPlan], ...]):
    """Set these as the shape's prefill plan and row buckets (as `--apply` would); the previous ones to restore."""
    old = linear.PREFILL_TUNED.get((n, k)), linear.PREFILL_ROW_BUCKETS.get((n, k))
    linear.PREFILL_TUNED[n, k] = base
    linear.PREFILL_ROW_BUCKETS[n, k] = buckets
    if buckets:
        linear.check_row_buckets({(n, k): buckets}, linear.prefill_gemm_plan)
    return old


def restore(n: int, k: int, old) -> None:
    for table, plan in zip((linear.PREFILL_TUNED, linear.PREFILL_ROW_BUCKETS), old, strict=True):
        table.pop((n, k), None)
        if plan is not None:
            table[n, k] = plan


def run(preset: str, rows: list[int]) -> dict:
    torch.manual_seed(0)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": preset, "rows": rows,
                    "shapes": []}  # fmt: skip
    big = max(rows)
    forward = {m: {"cublas": 0.0, "grid": 0.0, "best": 0.0, "bucketed": 0.0} for m in rows}
    for (n, k), count in prefill_shapes(preset).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(big, k, device="cuda", dtype=torch.bfloat16)
        current = prefill_gemm_plan(n, k)
        reference = invariant_matmul_triton(x, w, current)
        entry = {"n": n, "k": k, "count": count, "current": repr(current), "plans": {}, "cublas_us": {}}
        for m in rows:
            entry["cublas_us"][m] = graph_us(lambda a, b: F.linear(a, b), x[:m], [w])
        for name, plan in candidates(n, k).items():
            e = entry["plans"][name] = {"plan": repr(plan), "fields": dataclasses.asdict(plan)}
            e["same_sums"] = same_sums(plan, current, n, k)
            try:
                full = invariant_matmul_triton(x, w, plan)
                e["equals_current"] = torch.equal(full, reference)
                one = slice(big // 2, big // 2 + 1)  # a row from the middle, alone
                e["invariant"] = all(
                    torch.equal(invariant_matmul_triton(x[:m], w, plan), full[:m]) for m in (1, 129, min(rows))
                ) and torch.equal(invariant_matmul_triton(x[one], w, plan), full[one])
                e["us"] = {m: graph_us(lambda a, b, p=plan: invariant_matmul_triton(a, b, p), x[:m], [w]) for m in rows}
            except Exception as err:  # a plan that does not compile (shared memory) is reported, not fatal
                e["error"] = _error(err)
        usable = {a: b for a, b in entry["plans"].items() if b.get("invariant")}
        cost = {a: sum(b["us"][m] / entry["cublas_us"][m] for m in rows) for a, b in usable.items()}
        best = entry["best"] = min(cost, key=cost.get) if cost else None
        base, buckets = pick_prefill_buckets(entry, rows)
        if base is not None:
            plans = {a: GemmPlan(**entry["plans"][a]["fields"]) for a in {base, *(b for _, b in buckets)}}
            entry["bucketed"] = bucketed = {"base": base, "buckets": [list(b) for b in buckets]}
            old = dispatch(n, k, plans[base], tuple((fewest, plans[a]) for fewest, a in buckets))
            try:  # the launch as the engine makes it (the linear op, plan from M): a row's bits at every M, us per M
                with linear.prefill_rows(), torch.inference_mode():
                    full = engine_linear(x, w)
                    bucketed["invariant"] = all(
                        torch.equal(engine_linear(x[:m], w), full[:m]) for m in DISPATCH_CHECK_M
                    ) and torch.equal(full, reference)
                    bucketed["us"] = {m: graph_us(engine_linear, x[:m], [w]) for m in rows}
            finally:
                restore(n, k, old)
        for m in rows:
            forward[m]["cublas"] += entry["cublas_us"][m] * count
            forward[m]["grid"] += (entry["plans"]["grid128x128"].get("us", {}).get(m, float("nan"))) * count
            forward[m]["best"] += (usable[best]["us"][m] if best else float("nan")) * count
            forward[m]["bucketed"] += entry.get("bucketed", {}).get("us", {}).get(m, float("nan")) * count
        report["shapes"].append(entry)
        print(f"{n}x{k} (x{count}) best {best}; us per M {rows}: cuBLAS " +
              " ".join(f"{entry['cublas_us'][m]:.0f}" for m in rows))  # fmt: skip
        if "bucketed" in entry:
            b = entry["bucketed"]
            print(f"  bucketed: {b['base']} then {b['buckets']}, invariant {b['invariant']}: " +
                  " ".join(f"{b['us'][m]:.0f} ({b['us'][m] / entry['cublas_us'][m]:.2f}x)" for m in rows))  # fmt: skip
        for name, e in entry["plans"].items():
            if "error" in e:
                print(f"  {name:18s} ERROR {e['error']}")
                continue
            ratio = " ".join(f"{e['us'][m]:.0f} ({e['us'][m] / entry['cublas_us'][m]:.2f}x)" for m in rows)
            print(f"  {name:18s} {ratio}  invariant {e['invariant']} equals current {e['equals_current']} "
                  f"(same_sums {e['same_sums']})")  # fmt: skip
        del w, x, reference
        torch.cuda.empty_cache()
    report["forward_ms"] = {m: {a: b / 1e3 for a, b in f.items()} for m, f in forward.items()}
    for m, f in report["forward_ms"].items():
        grid, best, bucketed = (f[a] / f["cublas"] for a in ("grid", "best", "bucketed"))
        print(f"one forward's linears at M={m}: cuBLAS {f['cublas']:.2f} ms, grid plan {f['grid']:.2f} "
              f"({grid:.2f}x), best candidate {f['best']:.2f} ({best:.2f}x), row buckets {f['bucketed']:.2f} "
              f"({bucketed:.2f}x)")  # fmt: skip
    return report


def apply(report: dict, path: str = "qwen_mtp/ops/linear.py") -> None:
    """Write each shape's plans into PREFILL_TUNED and PREFILL_ROW_BUCKETS (the other presets' entries stay): its
    row-bucketed plans where the engine's dispatch of them kept every row's bits (`bucketed`), else its best
    invariant candidate over all rows with no buckets."""
    table, buckets = dict(linear.PREFILL_TUNED), dict(linear.PREFILL_ROW_BUCKETS)
    for e in report["shapes"]:
        plan = lambda label, e=e: GemmPlan(**e["plans"][label]["fields"])  # noqa: E731
        b = e.get("bucketed", {})
        if b.get("invariant"):
            table[e["n"], e["k"]] = plan(b["base"])
            buckets[e["n"], e["k"]] = tuple((fewest, plan(label)) for fewest, label in b["buckets"])
        elif e["best"]:
            table[e["n"], e["k"]] = plan(e["best"])
            buckets.pop((e["n"], e["k"]), None)
    write_plan_table(table, "PREFILL_TUNED", path)
    write_buckets({key: entries for key, entries in buckets.items() if entries}, path, "PREFILL_ROW_BUCKETS")


def write_plan_table(table: dict[tuple[int, int], GemmPlan], name: str, path: str) -> None:
    """Replace the plan table `name` (N, K) -> GemmPlan in the file at `path` with `table`."""
    lines = [f"    ({n}, {k}): {plan_text(plan)},\n" for (n, k), plan in table.items()]
    text = open(path).read()
    body = f"{name}: dict[tuple[int, int], GemmPlan] = {{\n" + "".join(lines) + "}\n"
    open(path, "w").write(table_pattern(name).sub(lambda _: body, text, count=1))


def cli(doc: str, preset: str, rows: str, run_sweep, apply_report, table: str) -> None:
    """The command line of a prefill plan sweep: --preset, --rows, --out (the JSON report), --apply (into `table`)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=preset, help="a synthetic preset: its decoder layers' shapes")
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--out", default=None)
    parser.add_argument("--apply", action="store_true", help=f"write the best plan per shape into {table}")
    args = parser.parse_args()
    report = run_sweep(args.preset, [int(m) for m in args.rows.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.apply:
        apply_report(report)


if __name__ == "__main__":
    cli(__doc__, "qwen3.5-27b", "512,1024,2048,4096,8192", run, apply, "PREFILL_TUNED")
