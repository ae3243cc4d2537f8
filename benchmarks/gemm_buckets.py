"""The invariant GEMM's row buckets on the GPU: which tilings give a row the same bits, and which is fastest for
each row count (ops/linear.py `ROW_BUCKETS`, `sum_order`).

A 128-row verify through a plan built for one request's decode runs four 32-row `tl.dot`s per weight block. On
Hopper a swapped plan's `tl.dot` is a wgmma whose N (the row side) can be 8..256; if an output element's value is
the same whatever the tiles around it (same K split points), a launch may take its row tile from M and each row
still gets the same bits.

`--set tiles` / `--set deep`: for each decode weight shape of a preset (lm_head included), M = 256 rows with the
shape's plan and with plans that change only the tiles (row tile, weight tile, warps, pipeline depth, K block,
swapped or not); which are bitwise equal to it; their times at M = 1 .. 256 against cuBLAS, with each plan's own
invariance across M.

`--set buckets`: bucket candidates (plans for 33+, 65+ and 129+ rows, W8A8 also 17+, that sum as the shape's plan
does), the fastest per bucket, written to ops/linear.py's table with `--apply`; then the launch as the engine makes
it against cuBLAS, a row's bits checked across the bucket edges. `--kind w8a8` does the same for the W8A8 kernel at
the FP8 shapes (`W8A8_ROW_BUCKETS`; cuBLAS on the dequantized weight as the baseline).

`--set dispatch`: only the launch as the engine makes it, with the shipped tables (no search), against cuBLAS at
every decode M, a row's bits checked across M and the bucket edges: issue #13's GEMM table in a minute or two.

`--set splits --splits 3,4,6,8`: the launch as the engine makes it, with the shape's plan and every bucket plan cut
into each of those K split counts instead of its own (all cut at the same points, so a row's bits still never
depend on M): whether more splits (fuller waves at few rows) win at M <= 32 and what the partial sums they write
cost at 64-256 rows. Nothing is applied: a split count changes the shape's numbers, so a winner is written into
`TUNED` / `TUNED_W8A8` and the buckets by hand, then checked by the exactness suite.

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/gemm_buckets.py [qwen3.5-27b] [name filter]
[--set tiles|deep|buckets|dispatch|splits] [--splits 3,4,6,8] [--apply] [--kind bf16|w8a8] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time

import torch
import torch.nn.functional as F
from apply_plans import plan_text
from gemm_family import (
    DECODE_M,
    ROTATION_BYTES,
    _cdiv,
    _compile,
    _error,
    graph_us,
    invariance_failures,
    named_once,
    precompile,
    shapes,
    write_json,
)
from gemm_fp8 import fp8_shapes, random_fp8
from gemm_w8a8 import _compile as _compile_w8a8

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import (
    FP8_BLOCK,
    GemmPlan,
    dequantize_triton,
    gemm_plan,
    gemm_plan_w8a8,
    invariant_matmul_triton,
    linear_fp8_w8a8_triton,
    same_sums,
)

SMEM_BYTES = 220 << 10


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a sweep times: a kernel (`call(x, weight, plan)`, plan None: the engine's choice), its per-shape plan,
    its tables in ops/linear.py, its weight shapes, and the weights it reads (with bf16 ones for cuBLAS)."""

    name: str  # its key in `linear.TMA_LOAD_BUCKETS`
    table: str
    tuned: str  # the table of per-shape plans `base` reads first
    base: object  # (n, k) -> GemmPlan
    call: object  # (x, weight, plan | None) -> out
    shapes: object  # (preset, only) -> {name: (n, k)}
    weights: object  # (n, k, copies) -> (ours, bf16 for cuBLAS)
    allowed: object  # plan -> whether the kernel runs it
    stage_bytes: int  # bytes of a weight element in a pipeline stage
    buckets: dict  # a bucket's first row count -> the row counts its plan is chosen by (the sum of their times)
    compile: object  # (n, k, plan) -> error or None: a precompile worker (gemm_family.precompile)


def _bf16_weights(n: int, k: int, copies: int):
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    return ws, ws


def _fp8_weights(n: int, k: int, copies: int):
    fp8 = [random_fp8(n, k, seed) for seed in range(copies)]
    return fp8, [dequantize_triton(q, sc, torch.bfloat16) for q, sc in fp8[: max(1, copies // 2)]]


# The W8A8 27B plans run 16-row tiles up to 16 rows (`TUNED_W8A8`); 32-row tiles won at 17-32 rows, so that kernel's
# sweep keeps a bucket from 17 rows.
BUCKETS = {33: (64,), 65: (96, 128), 129: (256,)}
W8A8_BUCKETS = {17: (32,), **BUCKETS}

KINDS = {
    "bf16": Kind(
        "bf16", "ROW_BUCKETS", "TUNED", gemm_plan, lambda x, w, p: invariant_matmul_triton(x, w, p), shapes,
        _bf16_weights, lambda p: True, 2, BUCKETS, _compile,
    ),
    "w8a8": Kind(
        "w8a8", "W8A8_ROW_BUCKETS", "TUNED_W8A8", gemm_plan_w8a8,
        lambda x, w, p: linear_fp8_w8a8_triton(x, w[0], w[1], p),
        lambda preset, only: named_once(fp8_shapes(preset), only), _fp8_weights,
        lambda p: p.block_k == FP8_BLOCK[1] and not p.tail_tiles, 1, W8A8_BUCKETS, _compile_w8a8,
    ),
}  # fmt: skip


def stages_for(block_n: int, block_m: int, block_k: int, most: int = 4) -> int:
    """The deepest pipeline (2..most) whose buffers fit in an SM's shared memory."""
    per_stage = (block_n + block_m) * block_k * 2
    return max(2, min(most, SMEM_BYTES // per_stage))


def variants(base: GemmPlan) -> dict[str, GemmPlan]:
    """Plans whose elements should equal `base`'s: the same block_k and K splits (and split tail), other tiles."""
    one = dataclasses.replace(base, family="stream", row_tiles=1, wide_stages=0)
    plain = dataclasses.replace(one, tail_tiles=0, tail_splits=1)  # the tail changes the tail tiles' sums
    out = {"now": base, "rt1": one}
    for bm in (16, 64, 128, 256):  # 16: a one-request decode's row tile (the W8A8 plans' up to 16 rows)
        out[f"swap bm{bm}"] = dataclasses.replace(one, block_m=bm, num_stages=stages_for(one.block_n, bm, one.block_k))
    for bn, bm, warps in ((128, 64, 8), (128, 128, 8), (128, 256, 8), (256, 128, 8), (256, 64, 8)):
        stages = stages_for(bn, bm, plain.block_k)
        out[f"swap bn{bn} bm{bm} w{warps}"] = dataclasses.replace(
            plain, block_n=bn, block_m=bm, num_warps=warps, num_stages=stages, swap_ab=True
        )
    for bn, bm in ((128, 64), (128, 128), (256, 128)):
        out[f"noswap bn{bn} bm{bm}"] = dataclasses.replace(
            plain, block_n=bn, block_m=bm, num_warps=8, num_stages=stages_for(bn, bm, plain.block_k), swap_ab=False
        )
    if base.tail_tiles:
        out["no tail"] = dataclasses.replace(plain, num_stages=base.num_stages)
    return out


def with_block_k(plan: GemmPlan, block_k: int) -> GemmPlan:
    """The plan with another K block but the same K split points (k_per_split and the tail's in K elements)."""
    scale = plan.block_k // block_k
    return dataclasses.replace(plan, block_k=block_k, k_per_split=plan.k_per_split * scale)


def deep_variants(base: GemmPlan) -> dict[str, GemmPlan]:
    """Wide row tiles with 64-deep K blocks (more pipeline stages in the same shared memory), and the 128x256 tile
    a dense GEMM library takes, swapped and not; do 64-deep K blocks keep the 128-deep plan's sums?"""
    one = dataclasses.replace(base, family="stream", row_tiles=1, wide_stages=0)
    plain = dataclasses.replace(one, tail_tiles=0, tail_splits=1)
    out = {
        "now": base,
        "swap bm128": dataclasses.replace(one, block_m=128, num_stages=stages_for(one.block_n, 128, 128)),
    }
    if base.tail_tiles:
        out["no tail"] = dataclasses.replace(plain, num_stages=base.num_stages)
    for bm, bk in ((64, 64), (128, 64)):
        for stages in (4, 6):
            out[f"swap bm{bm} k{bk} s{stages}"] = with_block_k(
                dataclasses.replace(one, block_m=bm, num_stages=stages), bk
            )
    for swap, bn, bm, warps, stages in (
        (True, 128, 128, 8, 4), (True, 128, 128, 4, 4), (True, 256, 128, 8, 3), (True, 256, 128, 8, 4),
        (False, 256, 128, 8, 3), (False, 256, 128, 8, 4), (False, 128, 128, 8, 5), (True, 128, 256, 8, 3),
        (True, 64, 256, 4, 3),
    ):  # fmt: skip
        label = f"{'swap' if swap else 'noswap'} bn{bn} bm{bm} k64 w{warps} s{stages}"
        tile = dataclasses.replace(plain, block_n=bn, block_m=bm, num_warps=warps, num_stages=stages, swap_ab=swap)
        out[label] = with_block_k(tile, 64)
    return out


def retile(base: GemmPlan, n: int, k: int, **fields) -> GemmPlan | None:
    """`base` with other tiles (fields), its K split points kept (k_per_split in K elements; a split tail over the
    same columns): the plan, or None where no such plan sums as `base` does."""
    block_k = fields.pop("block_k", base.block_k)
    plan = with_block_k(dataclasses.replace(base, family="stream", row_tiles=1, wide_stages=0, **fields), block_k)
    if base.tail_tiles:
        columns = base.tail_tiles * base.block_n - (-n % base.block_n)  # the tail's columns that exist
        tiles = -(-(columns + (-n % plan.block_n)) // plan.block_n)
        plan = dataclasses.replace(plan, tail_tiles=tiles)
    return plan if same_sums(plan, base, n, k) else None


NOSWAP = dict(swap_ab=False)
# Bucket candidates: label -> fields replaced in the shape's plan (one row tile a pass, its K split points kept).
BUCKET_TILES: dict[str, dict] = {
    "bm64": dict(block_m=64, num_stages=4),
    "bm64 k64 s6": dict(block_m=64, block_k=64, num_stages=6),
    "bm64 k64 s8": dict(block_m=64, block_k=64, num_stages=8),
    "bm128": dict(block_m=128, num_stages=3),
    "bm128 k64 s5": dict(block_m=128, block_k=64, num_stages=5),
    "bm128 k64 s6": dict(block_m=128, block_k=64, num_stages=6),
    "bn128 bm128 k64 w8 s6": dict(block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=6),
    "bn256 bm128 k64 w8 s4": dict(block_n=256, block_m=128, block_k=64, num_warps=8, num_stages=4),
    "noswap bn128 bm128 k64 w8 s5": dict(NOSWAP, block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=5),
    "noswap bn256 bm128 k64 w8 s4": dict(NOSWAP, block_n=256, block_m=128, block_k=64, num_warps=8, num_stages=4),
    "bm256 k64 s4": dict(block_m=256, block_k=64, num_stages=4),
    "bn128 bm256 k64 w8 s3": dict(block_n=128, block_m=256, block_k=64, num_warps=8, num_stages=3),
    "bn128 bm256 k64 w8 s4": dict(block_n=128, block_m=256, block_k=64, num_warps=8, num_stages=4),
}  # fmt: skip
# The W8A8 kernel's candidates: its K block is one 1x128 activation group, and an e4m3 stage is half a bf16 one.
W8A8_TILES: dict[str, dict] = {
    "bm32": dict(block_m=32, num_stages=4),
    "bm64": dict(block_m=64, num_stages=4),
    "bm128": dict(block_m=128, num_stages=4),
    "bm128 s6": dict(block_m=128, num_stages=6),
    "bn128 bm64 w8 s6": dict(block_n=128, block_m=64, num_warps=8, num_stages=6),
    "bn128 bm128 w8 s4": dict(block_n=128, block_m=128, num_warps=8, num_stages=4),
    "bn128 bm128 w8 s6": dict(block_n=128, block_m=128, num_warps=8, num_stages=6),
    "bn256 bm128 w8 s4": dict(block_n=256, block_m=128, num_warps=8, num_stages=4),
    "noswap bn128 bm128 w8 s4": dict(NOSWAP, block_n=128, block_m=128, num_warps=8, num_stages=4),
    "bn128 bm256 w8 s3": dict(block_n=128, block_m=256, num_warps=8, num_stages=3),
    "bm256 s4": dict(block_m=256, num_stages=4),
}  # fmt: skip


def bucket_variants(base: GemmPlan, n: int, k: int, kind: Kind) -> dict[str, GemmPlan]:
    """The shape's plan and every bucket candidate that sums as it does, runs on the kind's kernel and fits in
    shared memory (the W8A8 kernel's K block is one activation group: its own candidates, `W8A8_TILES`)."""
    out = {"now": base}
    for label, fields in (BUCKET_TILES if kind.table == "ROW_BUCKETS" else W8A8_TILES).items():
        if not kind.allowed(base):
            continue
        plan = retile(base, n, k, **fields)
        if plan is None or not kind.allowed(plan):
            continue
        if SMEM_BYTES >= plan.num_stages * (plan.block_n + plan.block_m) * plan.block_k * kind.stage_bytes:
            out[label] = plan
    return out


def pick_buckets(entry: dict, base: GemmPlan, buckets: dict = BUCKETS) -> tuple[tuple[int, GemmPlan], ...]:
    """The fastest invariant plan equal to the shape's plan per bucket of `buckets` (the shape's plan itself where
    it wins); empty when it wins every bucket."""
    ok = {label: r for label, r in entry["plans"].items() if r["equal"] and not r["invariance_failures"]}
    chosen = []
    for fewest, rows in buckets.items():
        label = min(ok, key=lambda lb: sum(ok[lb]["us"][m] for m in rows))
        chosen.append((fewest, GemmPlan(**ok[label]["plan"]) if label != "now" else base))
    return () if all(plan == base for _, plan in chosen) else tuple(chosen)


def write_buckets(table: dict[tuple[int, int], tuple[tuple[int, GemmPlan], ...]], path: str, name: str) -> None:
    """Replace the table `name` (ROW_BUCKETS, W8A8_ROW_BUCKETS) between its markers in ops/linear.py."""
    lines = [f"{name}: dict[tuple[int, int], tuple[tuple[int, GemmPlan], ...]] = {{"]
    for (n, k), entries in sorted(table.items()):
        lines.append(f"    ({n}, {k}): (")
        lines += [f"        ({fewest}, {plan_text(plan)})," for fewest, plan in entries]
        lines.append("    ),")
    lines.append("}")
    replace_block(path, name, lines)


def replace_block(path: str, name: str, lines: list[str]) -> None:
    """Replace the lines between `# BEGIN name` and `# END name` in the file at `path` (a table --apply writes)."""
    text = open(path).read()
    start = text.index("\n", text.index(f"# BEGIN {name} ")) + 1
    end = text.index(f"# END {name}\n")
    with open(path, "w") as f:
        f.write(text[:start] + "\n".join(lines) + "\n" + text[end:])


def resplit_tables(n: int, k: int, kind: Kind, splits: int) -> tuple[GemmPlan, tuple[tuple[int, GemmPlan], ...]]:
    """The shape's plan and its row buckets with K cut into `splits` pieces at the same points for all of them (in
    K elements, a multiple of every plan's K block), each plan's tiles kept."""
    base, entries = kind.base(n, k), getattr(linear, kind.table).get((n, k), ())
    if base.tail_tiles or any(plan.tail_tiles for _, plan in entries):
        raise ValueError(f"{n}x{k}: a plan with a split tail keeps its own split points")
    step = max(plan.block_k for plan in (base, *(plan for _, plan in entries)))
    columns = _cdiv(_cdiv(k, step), splits) * step

    def cut(plan: GemmPlan) -> GemmPlan:
        return dataclasses.replace(plan, k_per_split=columns // plan.block_k)

    table = {(n, k): tuple((fewest, cut(plan)) for fewest, plan in entries)}
    linear.check_row_buckets(table, lambda *_: cut(base))
    return cut(base), table[n, k]


@contextlib.contextmanager
def tables_as(n: int, k: int, kind: Kind, base: GemmPlan, entries: tuple[tuple[int, GemmPlan], ...]):
    """The engine's plan tables with the shape's plan and buckets replaced, restored on leaving."""
    tuned, buckets = getattr(linear, kind.tuned), getattr(linear, kind.table)
    saved = tuned.get((n, k)), buckets.get((n, k))
    tuned[n, k] = base
    if entries:
        buckets[n, k] = entries
    try:
        yield
    finally:
        for table, old in ((tuned, saved[0]), (buckets, saved[1])):
            table.pop((n, k), None)
            if old is not None:
                table[n, k] = old


def split_sweep(name: str, n: int, k: int, kind: Kind, counts: tuple[int, ...], jobs: int) -> dict:
    """The engine's launch of one shape at each K split count (`resplit_tables`) at every decode M against cuBLAS,
    a row's bits checked across M and the bucket edges (`dispatch_entry`); its own split count first."""
    own = kind.base(n, k).splits(k)
    tables = {}
    for splits in dict.fromkeys((own, *counts)):
        base, entries = resplit_tables(n, k, kind, splits)
        tables.setdefault(base.splits(k), (base, entries))  # counts that cut K at the same points: once
    loads = linear.TMA_LOAD_BUCKETS[kind.name]
    tasks = []
    for base, entries in tables.values():
        with tables_as(n, k, kind, base, entries):
            starts = (1, *(fewest for fewest, _ in entries))
            table = getattr(linear, kind.table)
            tasks += [(n, k, linear.row_plan(n, k, m, True, table, kind.base, loads)) for m in starts]
    errors = precompile(tasks, jobs, kind.compile)
    print(f"\n{name} {n}x{k}: {len(tasks)} plans compiled, {len(errors)} errors {sorted(set(errors))[:2]}", flush=True)
    print(f"  {'splits':8s} " + " ".join(f"{'M=' + str(m):>6s}" for m in DECODE_M) + "   (x cuBLAS)")
    out = {}
    for splits, (base, entries) in tables.items():
        with tables_as(n, k, kind, base, entries):
            try:
                e = dispatch_entry(n, k, kind)
            except Exception as err:
                print(f"  {splits:<8d} failed: {_error(err)}")
                continue
        out[splits] = e
        cells = " ".join(f"{e['us'][m] / e['cublas_us'][m]:6.2f}" for m in DECODE_M)
        inv = "inv" if not e["invariance_failures"] else "NOT-INV " + ",".join(e["invariance_failures"][:4])
        vs = " ".join(f"{e['us'][m] / out[own]['us'][m]:.2f}" for m in (1, 16, 32, 128)) if own in out else ""
        print(f"  {splits:<8d} {cells}  m1={e['us'][1]:.1f} us  x{own}-split M=1/16/32/128: {vs}  {inv}", flush=True)
    return dict(n=n, k=k, own_splits=own, splits={str(s): e for s, e in out.items()})


BUCKET_CHECK_M = (1, 8, 16, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 200, 255)


def dispatch_entry(n: int, k: int, kind: Kind) -> dict:
    """The launch as the engine makes it (plan from M): us per call against cuBLAS at every decode M, and whether a
    row's bits are the same at every M, across the bucket edges, and alone."""
    ws, dense = kind.weights(n, k, max(1, _cdiv(ROTATION_BYTES, n * k * kind.stage_bytes)))
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)

    def engine(a, w):
        return kind.call(a, w, None)

    full = engine(x, ws[0])
    fails = [f"M={m}" for m in BUCKET_CHECK_M if not torch.equal(engine(x[:m], ws[0]), full[:m])]
    fails += [
        f"row {i} alone" for i in (0, 40, 100, 255) if not torch.equal(engine(x[i : i + 1], ws[0]), full[i : i + 1])
    ]
    table = getattr(linear, kind.table)
    loads = linear.TMA_LOAD_BUCKETS[kind.name]
    entry = dict(
        cublas_us={m: graph_us(F.linear, x[:m], dense) for m in DECODE_M},
        us={m: graph_us(engine, x[:m], ws) for m in DECODE_M}, invariance_failures=fails,
        plans={m: dataclasses.asdict(linear.row_plan(n, k, m, True, table, kind.base, loads)) for m in DECODE_M},
    )  # fmt: skip
    del ws, x
    torch.cuda.empty_cache()
    return entry


VARIANT_SETS = {"tiles": variants, "deep": deep_variants}


def measure(n: int, k: int, plans: dict[str, GemmPlan], kind: Kind) -> dict:
    ws, dense = kind.weights(n, k, max(1, _cdiv(ROTATION_BYTES, n * k * kind.stage_bytes)))
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    entry = dict(n=n, k=k, cublas_us={m: graph_us(F.linear, x[:m], dense) for m in DECODE_M}, plans={}, skipped={})
    reference = {}
    for label, plan in plans.items():

        def fn(a, w, p=plan):
            return kind.call(a, w, p)

        try:
            rows = fn(x, ws[0])
            has_tail = bool(plan.tail_tiles)
            key = ("tail" if has_tail else "plain", plan.splits(k))  # a K block size of its own still compared
            reference.setdefault(key, (label, rows))
            ref_label, ref_rows = reference[key]
            fails = invariance_failures(fn, x, ws[0])
            us = {m: graph_us(fn, x[:m], ws) for m in DECODE_M}
        except Exception as err:
            entry["skipped"][label] = _error(err)
            continue
        entry["plans"][label] = dict(
            plan=dataclasses.asdict(plan), us=us, invariance_failures=fails, equals=ref_label,
            equal=bool(torch.equal(rows, ref_rows)), max_diff=float((rows.float() - ref_rows.float()).abs().max()),
        )  # fmt: skip
    del ws, x
    torch.cuda.empty_cache()
    return entry


def print_entry(name: str, e: dict) -> None:
    cb = e["cublas_us"]
    print(f"\n{name} {e['n']}x{e['k']}: us per call (x cuBLAS); '= plan' means bitwise equal to that plan at M=256")
    print(f"  {'cuBLAS':26s} " + " ".join(f"{cb[m]:6.1f}" for m in DECODE_M))
    for label, r in e["plans"].items():
        cells = " ".join(f"{r['us'][m] / cb[m]:6.2f}" for m in DECODE_M)
        inv = "inv" if not r["invariance_failures"] else "NOT-INV " + ",".join(r["invariance_failures"][:3])
        eq = f"= {r['equals']}" if r["equal"] else f"DIFFERS from {r['equals']} by {r['max_diff']:.3g}"
        print(f"  {label:26s} {cells}  m1={r['us'][1]:.1f} m128={r['us'][128]:.1f}  {inv}  {eq}")
    for label, err in e["skipped"].items():
        print(f"  {label:26s} skipped: {err}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset", nargs="?", default="qwen3.5-27b")
    parser.add_argument("only", nargs="?", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", default="tiles", choices=[*VARIANT_SETS, "buckets", "dispatch", "splits"],
                        help="which plans to compare")  # fmt: skip
    parser.add_argument("--splits", default="3,4,6,8", help="--set splits: the K split counts to time")
    parser.add_argument("--apply", action="store_true", help="with --set buckets: write the winners to ops/linear.py")
    parser.add_argument("--kind", default="bf16", choices=sorted(KINDS), help="which kernel (w8a8: --set buckets)")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    args = parser.parse_args()
    kind = KINDS[args.kind]
    if args.kind != "bf16" and args.set not in ("buckets", "dispatch", "splits"):
        parser.error("--kind w8a8 takes --set buckets, dispatch or splits")
    torch.manual_seed(0)
    t0 = time.time()
    if args.set == "splits":
        counts = tuple(int(s) for s in args.splits.split(",") if s)
        todo = {name: nk for name, nk in kind.shapes(args.preset, args.only).items() if "draft vocab" not in name}
        report = {name: split_sweep(name, n, k, kind, counts, args.jobs) for name, (n, k) in todo.items()}
        write_report(args.out or os.path.join(os.environ.get("OUT", "."), "gemm_splits.json"), report, t0)
        return
    if args.set == "dispatch":
        shapes = {name: nk for name, nk in kind.shapes(args.preset, args.only).items() if "draft vocab" not in name}
        report = {name: dict(n=n, k=k, dispatch=dispatch_entry(n, k, kind)) for name, (n, k) in shapes.items()}
        print_dispatch(report, kind.stage_bytes)
        write_report(args.out, report, t0)
        return
    todo = {}
    for name, (n, k) in kind.shapes(args.preset, args.only).items():
        if "draft vocab" in name:
            continue
        base = kind.base(n, k)
        variants_of = VARIANT_SETS.get(args.set)
        todo[name] = (n, k, bucket_variants(base, n, k, kind) if variants_of is None else variants_of(base))
    tasks = [(n, k, p) for n, k, plans in todo.values() for p in plans.values()]
    errors = precompile(tasks, args.jobs) if args.kind == "bf16" else []  # W8A8: compiled while measuring
    print(f"compiled in {time.time() - t0:.0f} s, {len(errors)} errors: {sorted(set(errors))[:3]}", flush=True)
    report = {}
    for name, (n, k, plans) in todo.items():
        report[name] = measure(n, k, plans, kind)
        print_entry(name, report[name])
    if args.set == "buckets":
        picked = {(e["n"], e["k"]): pick_buckets(e, kind.base(e["n"], e["k"]), kind.buckets) for e in report.values()}
        table = {nk: entries for nk, entries in picked.items() if entries}
        print("\nRow buckets chosen (first row count: plan):")
        for (n, k), entries in table.items():
            print(f"  ({n}, {k}): " + "; ".join(f"{fewest}+: {plan}" for fewest, plan in entries))
        linear.check_row_buckets(table, kind.base)
        current = getattr(linear, kind.table)
        for nk in picked:  # this preset's shapes take their new buckets; other presets' entries stay
            current.pop(nk, None)
        current.update(table)
        if args.apply:
            write_buckets({**current}, linear.__file__, kind.table)
        for name, (n, k, _) in todo.items():
            report[name]["dispatch"] = dispatch_entry(n, k, kind)
        print_dispatch(report, kind.stage_bytes)
    write_report(args.out, report, t0)


def one_row_line(report: dict, key: str, weight_bytes: int) -> tuple[float, float]:
    """One-row launch times as intercept + weight bytes / rate: the least-squares line through the shapes of
    `report` (their "dispatch" times under `key` at M = 1, the lm_head left out: one point 15x the others' bytes
    would fix the slope alone). Returns (intercept us, slope as TB/s; inf where time does not grow with size).
    At M = 1 a GEMM streams its weight, so the line says at a glance how far the launches are from the copy
    bandwidth and which shapes sit off it. Its intercept is not a cost every launch pays: each shape runs its own
    plan, and shapes that stream at different rates tilt the line (`launch_floor.py` times one plan over K and an
    empty kernel for that)."""
    points = []
    for name, e in report.items():
        times = e["dispatch"][key]  # M -> us; a report read back from JSON has string keys
        if "lm_head" not in name:
            points.append((e["n"] * e["k"] * weight_bytes / 1e6, times[1] if 1 in times else times["1"]))
    if len({mb for mb, _ in points}) < 2:
        raise ValueError("one_row_line needs two shapes of different sizes")
    mean_mb, mean_us = (sum(p[i] for p in points) / len(points) for i in (0, 1))
    spread = sum((mb - mean_mb) ** 2 for mb, _ in points)
    us_per_mb = sum((mb - mean_mb) * (us - mean_us) for mb, us in points) / spread
    return mean_us - us_per_mb * mean_mb, 1 / us_per_mb if us_per_mb > 0 else float("inf")


def print_dispatch(report: dict, weight_bytes: int = 2) -> None:
    """The engine's launch per shape of `report` (each entry's "dispatch"): x cuBLAS at each decode M, its time at
    M = 1, the invariance verdict, and both launches' one-row times as a line through the shapes (`one_row_line`;
    `weight_bytes`: a weight element's bytes in our launch, 1 for e4m3; cuBLAS always reads bf16)."""
    print("\nThe launch as the engine makes it (row plan from M), x cuBLAS; 'inv': a row's bits at every M")
    print(f"  {'shape':28s} " + " ".join(f"{'M=' + str(m):>6s}" for m in DECODE_M))
    for name, entry in report.items():
        d = entry["dispatch"]
        cells = " ".join(f"{d['us'][m] / d['cublas_us'][m]:6.2f}" for m in DECODE_M)
        inv = "inv" if not d["invariance_failures"] else "NOT-INV " + ",".join(d["invariance_failures"][:4])
        print(f"  {name:28s} {cells}  m1={d['us'][1]:.1f} us  {inv}")
    if sum("lm_head" not in name for name in report) >= 2:
        for label, key, size in (("ours", "us", weight_bytes), ("cuBLAS bf16", "cublas_us", 2)):
            intercept, rate = one_row_line(report, key, size)
            print(f"  one row, {label}: {intercept:.2f} us + weight bytes at {rate:.2f} TB/s (a line through shapes)")


def write_report(out: str | None, report: dict, t0: float) -> None:
    path = out or os.path.join(os.environ.get("OUT", "."), "gemm_buckets.json")
    write_json(path, dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shapes=report))
    print(f"{time.time() - t0:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
