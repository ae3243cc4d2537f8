"""Decode / verify attention on the GPU: the unsplit kernel (one program per row x position and KV head) against
split-KV (`SplitKvPlan` choices; the engine's plan is marked *), Qwen3.5-27B attention shapes (24 query / 4 KV
heads, head dim 256, bf16, pages of 64 on shuffled pages), B = 1 and 8 requests, T = 1 (decode) and 4 (verify,
K = 3), each request at the same context.

How it times: CUDA graphs, as the engine runs steps; every request's page table is as wide as the longest context
of the sweep (a graph's table covers the longest context it serves), so split-KV's programs past a row's last
chunk are paid for. One replay walks several copies of the cache (other pages) when one copy would sit in the
50 MB L2: keys come from HBM, as in a step that reads 16 layers and the weights between them. GB/s counts the KV
bytes of the requests' contexts once per call (a verify's positions share them).

Then bitwise checks at a batch of 10 mixed contexts (around 256 / 512 / 1024-key chunk boundaries and a 2048-key
lead's end): verify row t == a 1-token decode at its position; each request alone (its table only as wide as its
pages) == its row in the batch; a shuffled batch; the engine-wide table == the tight one; a captured graph replayed
with new context lengths == eager; and the largest difference from the reference and from the unsplit kernel.

Usage (GPU box, from the repo root; about 2 minutes on an H200):
    PYTHONPATH=. python3 benchmarks/decode_attention.py [--out PATH] [--contexts 128 2048 ...] [--engine-plan-only]
Writes JSON to PATH, else $OUT/decode_attention.json, else ./decode_attention.json; exits 1 if a bitwise check
failed.
"""

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict

import torch

from qwen_mtp.ops.paged_attention import (
    SPLIT_KV_PLAN,
    SplitKvPlan,
    paged_attention_reference,
    split_kv_attention_triton,
    unsplit_attention_triton,
)

DEVICE = "cuda"
HEADS, KV_HEADS, DIM, PAGE = 24, 4, 256, 64
SCALE = DIM**-0.5
CONTEXTS = [128, 2048, 8192, 32768, 131072]
BATCHES, LENGTHS = (1, 8), (1, 4)
PLANS = [
    SPLIT_KV_PLAN,
    SplitKvPlan(split=256),
    SplitKvPlan(split=1024),
    SplitKvPlan(split=512, block_n=64, warps=4),
    SplitKvPlan(split=512, block_n=64, warps=8),
    SplitKvPlan(split=256, programs=528),
    SplitKvPlan(split=256, merge=64),
    SplitKvPlan(rows=16),  # decode's tile before the positions shared it; a K=3 verify then takes two tiles
    SplitKvPlan(warps=8),
    SplitKvPlan(prefetch=True),  # each block's keys and values loaded one iteration early
    SplitKvPlan(prefetch=True, warps=8),
    SplitKvPlan(lead=2048, lead_split=64),  # the first 2048 keys in 64-key chunks
    SplitKvPlan(split=64),  # short chunks: at 128 keys of context, 3 chunks of 2 blocks in parallel
    SplitKvPlan(lead=1024, lead_split=64),
    SplitKvPlan(lead=4096, lead_split=64),
    SplitKvPlan(lead=2048, lead_split=128),
    SplitKvPlan(lead=2048, lead_split=64, split=1024),
]
COLD_BYTES = 256 * 2**20  # KV one timed replay walks through: ~5x the H200's L2
CHECK_CONTEXTS = [511, 512, 513, 1027, 4096, 8191, 100, 20001, 2047, 2049]


def pages_for(positions: int) -> int:
    return -(-positions // PAGE)


def kv_bytes(batch: int, context: int) -> int:
    return batch * context * KV_HEADS * DIM * 2 * 2  # keys and values, bf16


def name(plan: SplitKvPlan | None) -> str:
    if plan is None:
        return "unsplit"
    mark = "*" if plan == SPLIT_KV_PLAN else ""
    early = "/prefetch" if plan.prefetch else ""
    lead = f"lead {plan.lead}/{plan.lead_split} then " if plan.lead else ""
    shape = f"{plan.split}/{plan.block_n}/r{plan.rows}/w{plan.warps}/p{plan.programs}/m{plan.merge}"
    return f"split {lead}{shape}{early}{mark}"


def same_sums(plan: SplitKvPlan) -> bool:
    """Whether the plan sums as the engine's does (the same chunks, blocks, tile rows and merge lanes): its output
    must then be the engine plan's bit for bit."""
    return (plan.split, plan.block_n, plan.rows, plan.merge, plan.lead, plan.lead_split) == (
        SPLIT_KV_PLAN.split, SPLIT_KV_PLAN.block_n, SPLIT_KV_PLAN.rows, SPLIT_KV_PLAN.merge, SPLIT_KV_PLAN.lead,
        SPLIT_KV_PLAN.lead_split,
    )  # fmt: skip


def attend(plan: SplitKvPlan | None, q, kv, tables, lens):
    if plan is None:
        return unsplit_attention_triton(q, kv, tables, lens, SCALE)
    return split_kv_attention_triton(q, kv, tables, lens, SCALE, plan)


def cache(contexts: list[int], copies: int, width: int, gen: torch.Generator):
    """KV pool (page 0: the scratch page tables are padded with) and `copies` page tables [copies, B, width] for
    requests at `contexts`, every table on pages of its own, shuffled."""
    need = [pages_for(c) for c in contexts]
    pool = copies * sum(need) + 1
    kv = torch.randn(2, pool, PAGE, KV_HEADS, DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(pool - 1, device=DEVICE, generator=gen).int() + 1
    tables = torch.zeros(copies, len(contexts), width, dtype=torch.int32, device=DEVICE)
    used = 0
    for c in range(copies):
        for b, n in enumerate(need):
            tables[c, b, :n] = order[used : used + n]
            used += n
    return kv, tables


def graph_us(call, copies: int) -> float:
    """Microseconds per call: a CUDA graph of `copies` calls (copy i reads table i), median of timed replays."""
    for i in range(copies):  # compile outside the capture (tables at other alignments may get their own binary)
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay_ms() -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    estimate = min(replay_ms() for _ in range(2))
    times = [replay_ms() for _ in range(max(5, min(100, int(80 / max(estimate, 1e-3)))))]
    return statistics.median(times) * 1e3 / copies


def time_kernels(q, kv, tables, lens) -> list[dict]:
    """Every kernel on one case; tables [copies, B, width]."""
    (batch, length), context, copies = q.shape[:2], int(lens[0]), tables.shape[0]
    records = []
    for plan in [None, *PLANS]:
        us = graph_us(lambda i, plan=plan: attend(plan, q, kv, tables[i], lens), copies)
        base = records[0]["us"] if records else us
        gbs = kv_bytes(batch, context) / us / 1e3
        print(
            f"B={batch} T={length} ctx={context:6d} {name(plan):34s} {us:9.1f} us  {gbs:6.0f} GB/s  "
            f"speedup {base / us:5.2f}x",
            flush=True,
        )
        records.append(dict(batch=batch, length=length, context=context, kernel=name(plan),
                            plan=plan and asdict(plan), us=us, kv_gb_s=gbs, speedup=base / us, copies=copies,
                            table_width=tables.shape[2]))  # fmt: skip
    return records


def sweep(contexts: list[int], batches: tuple[int, ...] = BATCHES) -> list[dict]:
    width = pages_for(max(contexts) + max(LENGTHS))
    report = []
    for batch in batches:
        for context in contexts:
            gen = torch.Generator(device=DEVICE).manual_seed(context * 10 + batch)
            copies = max(1, min(32, math.ceil(COLD_BYTES / kv_bytes(batch, context))))
            kv, tables = cache([context] * batch, copies, width, gen)
            lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
            for length in LENGTHS:
                q = torch.randn(batch, length, HEADS, DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
                report += time_kernels(q, kv, tables, lens)
            del kv, tables
            torch.cuda.empty_cache()
    return report


def checks() -> list[dict]:
    """Bitwise decode == verify, alone == batched, shuffled, wide table == tight, graph replay == eager."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    tight = pages_for(max(CHECK_CONTEXTS))
    kv, tables = cache(CHECK_CONTEXTS, 1, tight, gen)
    tables = tables[0]
    wide = torch.zeros(len(CHECK_CONTEXTS), pages_for(max(CONTEXTS) + max(LENGTHS)), dtype=torch.int32, device=DEVICE)
    wide[:, :tight] = tables
    lens = torch.tensor(CHECK_CONTEXTS, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(CHECK_CONTEXTS), 4, HEADS, DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    ref = paged_attention_reference(q, kv, tables, lens, SCALE)
    unsplit = unsplit_attention_triton(q, kv, tables, lens, SCALE)
    order = torch.randperm(len(CHECK_CONTEXTS), device=DEVICE, generator=gen)
    engine = attend(SPLIT_KV_PLAN, q, kv, tables, lens)
    report = []
    for plan in [None, *PLANS]:
        verify = attend(plan, q, kv, tables, lens)
        as_engine = plan is None or not same_sums(plan) or torch.equal(verify, engine)
        decode = all(
            torch.equal(attend(plan, q[:, t : t + 1].contiguous(), kv, tables, lens - 3 + t)[:, 0], verify[:, t])
            for t in range(4)
        )
        alone = all(
            torch.equal(
                attend(plan, q[b : b + 1], kv, tables[b : b + 1, : pages_for(c)].contiguous(), lens[b : b + 1]),
                verify[b : b + 1],
            )
            for b, c in enumerate(CHECK_CONTEXTS)
        )
        shuffled = torch.equal(attend(plan, q[order], kv, tables[order], lens[order]), verify[order])
        widened = torch.equal(attend(plan, q, kv, wide, lens), verify)
        static_lens = torch.full_like(lens, 4)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = attend(plan, q, kv, wide, static_lens)
        static_lens.copy_(lens)
        graph.replay()
        replay = torch.equal(replayed, verify)
        ref_diff = (verify.float() - ref.float()).abs().max().item()
        unsplit_diff = (verify.float() - unsplit.float()).abs().max().item()
        ok = decode and alone and shuffled and widened and replay and as_engine
        print(
            f"check {name(plan):34s} decode==verify {decode}  alone==batch {alone}  shuffled {shuffled}  "
            f"wide==tight {widened}  graph replay {replay}  same sums==plan* {as_engine}  max|diff| ref "
            f"{ref_diff:.3g} unsplit {unsplit_diff:.3g}  {'OK' if ok else 'FAILED'}",
            flush=True,
        )
        report.append(dict(kernel=name(plan), plan=plan and asdict(plan), decode_equals_verify=decode,
                           alone_equals_batch=alone, shuffled=shuffled, wide_equals_tight=widened,
                           graph_replay=replay, equals_engine_plan=as_engine, max_diff_reference=ref_diff,
                           max_diff_unsplit=unsplit_diff, ok=ok))  # fmt: skip
    return report


def table(report: list[dict]) -> None:
    """One line per (B, T, context): unsplit, the engine's plan, the fastest plan."""
    print(f"\n{'B':>2} {'T':>2} {'context':>7} | {'unsplit us':>10} {'GB/s':>5} | {'plan* us':>9} {'GB/s':>5} "
          f"{'x':>6} | {'fastest plan':34s} {'us':>8} {'x':>6}")  # fmt: skip
    cases = sorted({(r["batch"], r["length"], r["context"]) for r in report})
    for case in cases:
        rows = [r for r in report if (r["batch"], r["length"], r["context"]) == case]
        unsplit = next(r for r in rows if r["plan"] is None)
        ours = next(r for r in rows if r["plan"] == asdict(SPLIT_KV_PLAN))
        best = min((r for r in rows if r["plan"] is not None), key=lambda r: r["us"])
        print(
            f"{case[0]:2d} {case[1]:2d} {case[2]:7d} | {unsplit['us']:10.1f} {unsplit['kv_gb_s']:5.0f} | "
            f"{ours['us']:9.1f} {ours['kv_gb_s']:5.0f} {ours['speedup']:5.2f}x | {best['kernel']:34s} "
            f"{best['us']:8.1f} {best['speedup']:5.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path (default: $OUT/decode_attention.json or ./decode_attention.json)")
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--engine-plan-only", action="store_true", help="time the unsplit kernel and the engine's plan")
    parser.add_argument(
        "--same-sums-only", action="store_true", help="only plans that sum as the engine's (warps, programs, prefetch)"
    )
    args = parser.parse_args()
    if args.same_sums_only:
        PLANS[:] = [plan for plan in PLANS if same_sums(plan)]
    if args.engine_plan_only:
        PLANS[:] = [SPLIT_KV_PLAN]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    started = time.perf_counter()
    exact = checks()
    report = sweep(args.contexts, tuple(args.batches))
    table(report)
    failed = [r["kernel"] for r in exact if not r["ok"]]
    print("bitwise checks:", f"FAILED for {failed}" if failed else "all OK")
    out = args.out or os.path.join(os.environ.get("OUT", "."), "decode_attention.json")
    with open(out, "w") as f:
        json.dump(dict(checks=exact, timings=report), f, indent=2)
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
