"""Mixed steps (issue #20) on the GPU, packing on (`cache.mixed_steps`) against off, one loaded model:
1. gemm:  one forward's linears at prefill row counts (bf16), per weight shape and summed: the batch-invariant
          GEMM with its decode plans, cuBLAS (the unpacked prefill) and `prefill_plans`: the prefill plan packed
          prefills run (`prefill_gemm_plan`) and two alternatives;
2. ttft:  32 simultaneous 128-token prompts and 8 simultaneous 2048-token prompts: time to first token (mean,
          max) beside the compute floor (2 x linear params x prompt tokens at 700 TFLOP/s), and the decode
          tokens/s of the same batch after its prefill;
3. itl:   16 running requests while a 2048-token prompt arrives every 0.5 s: p50 / p99 of the running
          requests' gaps between token updates;
4. exact: packed tokens == each prompt's tokens alone (packing on: must hold), packed == packing off (reported:
          the prefill GEMM differs, so bf16 near-ties may flip), and with --k MTP-on == MTP-off (packing on).
With --profile, also the GPU time of one more packed 32 x 128 burst by kind of kernel, and its top kernels, and in
the ITL run (both modes) the GPU time split of one step carrying a long prompt's first chunk beside the running
requests' decode rows, and of one decode-only step, and the host time of two more chunk steps (by function, by
operator). The ITL run also reports how many steps carried a chunk and
their mean wall time against the decode-only steps'.
Writes JSON to --out (default $OUT/mixed-steps.json) and prints a summary.
Usage (GPU box): python3 benchmarks/mixed_steps.py recipes/bench-27b.yaml [--k 2] [--set cache.max_step_tokens=16384]
CPU smoke run:   python3 benchmarks/mixed_steps.py recipes/bench-tiny.yaml --scale 0.0625 --arrivals 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from bench_common import cpu_split, free_memory, gpu_split, host_split, sync, tokens  # benchmarks/bench_common.py

from qwen_mtp.engine import Engine, SamplingParams
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.ops.linear import GemmPlan, invariant_matmul_triton, prefill_gemm_plan
from qwen_mtp.recipe import load_recipe

FLOOR_FLOPS = 700e12  # a dense bf16 GEMM's practical peak on the H200 (issue #20's floor)


def make_engine(args, loaded, mixed: bool, k: int, batch: int) -> Engine:
    sets = (f"cache.mixed_steps={str(mixed).lower()}", f"cache.max_batch={batch}", f"cache.num_state_rows={batch}")
    sets += (("mtp.enabled=true", f"mtp.k={k}") if k else ("mtp.enabled=false",)) + tuple(args.set)
    engine = Engine.from_recipe(load_recipe(args.recipe, sets), loaded=loaded, log=lambda _: None)
    engine.warmup()
    engine.generate([tokens(16, seed=0, vocab=loaded.model.config.vocab_size)], max_new_tokens=2, ignore_eos=True)
    return engine


def timed(fn, reps: int = 10) -> float:
    """Seconds per call of fn (after a warm-up call)."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def linears(model) -> dict[tuple[int, int], list]:
    """The decoder layers' linear modules by weight shape [N, K] (what a prefill forward runs per token)."""
    found: dict[tuple[int, int], list] = {}
    for module in model.model.layers.modules():
        if isinstance(module, Linear | MergedLinear):
            found.setdefault(tuple(module.weight.shape), []).append(module)
    return found


def prefill_plans(n: int, k: int) -> dict[str, GemmPlan]:
    """Candidate batch-invariant plans for prefill row counts (a function of (N, K) only, like every plan): the
    plan packed prefills run now (`prefill_gemm_plan`: "grid", 128 x 128 tiles, no K split) and two other "grid"
    tilings without a K split, as a dense GEMM library tiles a large M. The decode plans (`gemm_plan`: "stream",
    16-32-row MMAs, one program per weight slice walking every row) are built for M = 1..64."""
    blocks = -(-k // 64)
    return {
        "prefill_gemm_plan": prefill_gemm_plan(n, k),
        "grid128x256": GemmPlan(256, 64, blocks, 8, 3, block_m=128),
        "grid64x128": GemmPlan(128, 64, blocks, 4, 4, block_m=64),
    }


@torch.inference_mode()
def gemm(model, rows: list[int]) -> dict:
    """Per weight shape [N, K] and row count M: the invariant GEMM with the decode plan, cuBLAS (`F.linear`, the
    unpacked prefill) and `prefill_plans` (the one packed prefills run, and alternatives); and one
    forward's linears summed (each shape its count of modules, the best candidate per shape)."""
    device, dtype = model.lm_head_weight.device, model.lm_head_weight.dtype
    shapes, report = linears(model), {"shapes": [], "forward": []}
    for m in rows:
        total = {"invariant": 0.0, "cublas": 0.0, "best_prefill_plan": 0.0}
        for (n, k), modules in shapes.items():
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype)
            t = {"invariant": timed(lambda x=x, w=w: invariant_matmul_triton(x, w))}
            t["cublas"] = timed(lambda x=x, w=w: F.linear(x, w))
            plans = {name: timed(lambda x=x, w=w, p=p: invariant_matmul_triton(x, w, p)) for name, p in
                     prefill_plans(n, k).items()}  # fmt: skip
            best = min(plans, key=plans.get)
            t["best_prefill_plan"] = plans[best]
            for name in total:
                total[name] += t[name] * len(modules)
            seconds = {f"{a}_s": b for a, b in t.items()}
            report["shapes"].append(dict(m=m, n=n, k=k, count=len(modules), best_plan=best, plans_s=plans, **seconds))
            candidates = ", ".join(f"{a} {b * 1e6:.0f} us" for a, b in plans.items())
            print(f"  M={m} {n}x{k} (x{len(modules)}): decode plan {t['invariant'] * 1e6:.0f} us, cuBLAS "
                  f"{t['cublas'] * 1e6:.0f} us, {candidates}")  # fmt: skip
        report["forward"].append(dict(m=m, **{f"{a}_s": b for a, b in total.items()}))
        print(f"gemm M={m:5d}: one forward's linears: invariant (decode plans) {total['invariant'] * 1e3:8.2f} ms, "
              f"cuBLAS {total['cublas'] * 1e3:8.2f} ms, best prefill plan {total['best_prefill_plan'] * 1e3:8.2f} ms "
              f"(invariant/cuBLAS {total['invariant'] / total['cublas']:.2f}x, "
              f"prefill plan/cuBLAS {total['best_prefill_plan'] / total['cublas']:.2f}x)")  # fmt: skip
    return report


def burst(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts submitted at once: TTFT per request, decode tokens/s after the last first token
    (`decode_rate`), tokens."""
    sync()
    start = time.perf_counter()
    ids = [engine.submit(p, SamplingParams(new_tokens, ignore_eos=True)) for p in prompts]
    first: dict[int, float] = {}
    steps: list[tuple[float, int]] = []  # (when a step's updates came back, how many tokens they carried)
    while engine.has_unfinished():
        updates = engine.step()
        now = time.perf_counter()
        steps.append((now, sum(len(update.new_token_ids) for update in updates)))
        for update in updates:
            if update.new_token_ids:
                first.setdefault(update.request_id, now)
    sync()
    end = time.perf_counter()
    failed = [engine.requests[i] for i in ids if engine.requests[i].finish_reason == "error"]
    if failed:
        error = failed[0].error
        raise SystemExit(f"{len(failed)} of {len(ids)} requests ended with an error, the first: {error!r}") from error
    ttft = [first[i] - start for i in ids]
    return {
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_max_s": max(ttft),
        "decode_tokens_per_s": decode_rate(steps, max(first.values()), end),
        "tokens": [engine.result(i).token_ids for i in ids],
    }


def decode_rate(steps: list[tuple[float, int]], since: float, end: float) -> float | None:
    """Tokens per second of the steps that came back after `since` (the step that gave the last request its
    first token), until `end`. Not every request's new tokens over that time: a request whose first token came
    early has decoded some of them before it, more of them the more the first tokens are spread (unpacked
    prefill spreads them over the whole burst), which would flatter the spread mode."""
    tokens = sum(count for when, count in steps if when > since)
    return tokens / (end - since) if end > since and tokens else None


def inter_token(engine: Engine, args, vocab: int) -> dict:
    """`--running` requests decode while a `--long`-token prompt arrives every `--interval` s (`--arrivals` of
    them): the running requests' gaps between token updates (one update per step that gave them tokens)."""
    running = [
        engine.submit(tokens(args.short, seed=500 + i, vocab=vocab), SamplingParams(args.itl_tokens, ignore_eos=True))
        for i in range(args.running)
    ]
    while any(engine.requests[r].in_prefill for r in running):
        engine.step()
    last = dict.fromkeys(running, time.perf_counter())
    gaps: list[float] = []
    start, arrived, arrivals = time.perf_counter(), 0, []
    chunk_steps: list[float] = []  # wall seconds of the steps that ran an arrival's prefill chunk
    decode_steps: list[float] = []  # and of the others
    while arrived < args.arrivals or any(not engine.requests[r].done for r in arrivals):
        if arrived < args.arrivals and time.perf_counter() - start >= arrived * args.interval:
            prompt = tokens(args.long, seed=700 + arrived, vocab=vocab)
            arrivals.append(engine.submit(prompt, SamplingParams(1, ignore_eos=True)))
            arrived += 1
        chunk = any(engine.requests[r].in_prefill for r in arrivals)
        before = time.perf_counter()
        updates = engine.step()
        now = time.perf_counter()
        (chunk_steps if chunk else decode_steps).append(now - before)
        for update in updates:
            if update.request_id in last and update.new_token_ids:
                gaps.append(now - last[update.request_id])
                last[update.request_id] = now
        if any(engine.requests[r].done for r in running):
            raise SystemExit(f"--itl-tokens {args.itl_tokens} ran out before the arrivals ended: raise it")
    profiled = profile_chunk_step(engine, args, vocab) if args.profile else None
    for rid in running:
        engine.cancel(rid)
        engine.result(rid)
    for rid in arrivals:
        engine.result(rid)
    gaps.sort()
    report = {
        "p50_ms": 1e3 * gaps[len(gaps) // 2],
        "p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))],
        "max_ms": 1e3 * gaps[-1],
        "updates": len(gaps),
        "chunk_steps": step_times(chunk_steps),
        "decode_steps": step_times(decode_steps),
    }
    if profiled is not None:
        report["chunk_step_gpu_ms"], report["decode_step_gpu_ms"], report["chunk_step_host"] = profiled
    return report


def step_times(seconds: list[float]) -> dict:
    """Count, mean and max of some steps' wall times (ms): the ITL run's p50 is a decode step's time or a chunk
    step's, depending on which kind is the majority of the steps."""
    if not seconds:
        return {"count": 0}
    return {"count": len(seconds), "mean_ms": 1e3 * statistics.mean(seconds), "max_ms": 1e3 * max(seconds)}


def profile_chunk_step(engine: Engine, args, vocab: int) -> tuple[dict, dict, dict]:
    """With the running requests still decoding: the GPU time split of one step that carries a new long
    prompt's first chunk beside their decode rows, then of one decode-only step (`gpu_split`), then the host
    functions of another such chunk step (`host_split`) and the host time by operator of a third (`cpu_split`)."""
    splits = []
    for seed, split in ((799, gpu_split), (798, host_split), (797, cpu_split)):
        arrival = engine.submit(tokens(args.long, seed=seed, vocab=vocab), SamplingParams(1, ignore_eos=True))
        splits.append(split(engine.step))
        while not engine.requests[arrival].done:
            engine.step()
        engine.result(arrival)
    splits[1]["top ops"] = splits.pop()
    return splits[0], gpu_split(engine.step), splits[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--k", type=int, default=0, help="also run MTP with this K (packing on) for MTP-on == off")
    parser.add_argument("--set", action="append", default=[], help="recipe override, e.g. cache.max_step_tokens=16384")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (CPU smoke runs)")
    parser.add_argument("--arrivals", type=int, default=6, help="long prompts arriving during the ITL run")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--itl-tokens", type=int, default=2048, help="max_new_tokens of the ITL run's decoders")
    parser.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens of the TTFT bursts")
    parser.add_argument("--solo", type=int, default=4, help="prompts of each burst also run alone (exactness)")
    parser.add_argument("--gemm-rows", default="128,512,2048,4096,8192", help="bf16 GEMM timings; '': none")
    parser.add_argument("--profile", action="store_true", help="GPU time splits: a packed 32 x 128 burst, a chunk step")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mixed-steps.json"))
    args = parser.parse_args()
    args.short, args.long = max(1, int(128 * args.scale)), max(1, int(2048 * args.scale))
    loaded = load_from_recipe(load_recipe(args.recipe, tuple(args.set)))
    model, vocab = loaded.model, loaded.model.config.vocab_size
    params = sum(n * k * len(m) for (n, k), m in linears(model).items())
    report: dict = {"recipe": args.recipe, "set": args.set, "k": args.k, "linear_params": params}
    report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if loaded.device.type == "cuda" and args.gemm_rows:
        report["gemm"] = gemm(model, [int(m) for m in args.gemm_rows.split(",")])
        with open(args.out, "w") as f:  # the GEMM part survives a failure later in the run
            json.dump(report, f, indent=1)

    bursts = {"32x128": [tokens(args.short, seed=i, vocab=vocab) for i in range(32)]}
    bursts["8x2048"] = [tokens(args.long, seed=100 + i, vocab=vocab) for i in range(8)]
    # Warm-up bursts of the same shapes, other tokens (no prefix is shared with the timed ones): a first burst
    # of 32 on a fresh engine measured ~1.3 s above the same burst on an engine that had run one
    warm = {case: [tokens(len(p), seed=9000 + 50 * j + i, vocab=vocab) for i, p in enumerate(prompts)]
            for j, (case, prompts) in enumerate(bursts.items())}  # fmt: skip
    batch = max(32, args.running + args.arrivals)
    results: dict = {}
    for mixed in (False, True):
        name = "packed" if mixed else "unpacked"
        engine = make_engine(args, loaded, mixed, 0, batch)
        for case, prompts in bursts.items():
            burst(engine, warm[case], 2)  # warm-up: whatever a burst of this shape builds, outside the timed one
            results[name, case] = burst(engine, prompts, args.new_tokens)
            got = results[name, case]
            # (what a run cut short by a time limit still reports)
            print(f"{name} {case}: TTFT mean {got['ttft_mean_s'] * 1e3:.1f} ms, max {got['ttft_max_s'] * 1e3:.1f} ms")
            if mixed:
                alone = [burst(engine, [p], args.new_tokens)["tokens"][0] for p in prompts[: args.solo]]
                results[name, case]["alone_exact"] = alone == results[name, case]["tokens"][: args.solo]
        if mixed and args.profile:  # where a packed burst's time goes (other tokens: nothing cached)
            profile_prompts = [tokens(len(p), seed=9500 + i, vocab=vocab) for i, p in enumerate(bursts["32x128"])]
            report["packed_32x128_gpu_ms"] = split = gpu_split(
                lambda engine=engine, prompts=profile_prompts: burst(engine, prompts, 1)
            )
            parts = "  ".join(f"{k} {v:.1f} ms" for k, v in split.items() if not isinstance(v, dict))
            print(f"packed 32x128 profile: {parts}")
            for kernel, ms in split["top kernels"].items():
                print(f"      {ms:9.1f} ms  {kernel}")
        results[name, "itl"] = inter_token(engine, args, vocab)
        del engine  # the last reference: the next engine sizes itself from the free memory
        free_memory()
    if args.k:
        engine = make_engine(args, loaded, True, args.k, batch)
        for case, prompts in bursts.items():
            burst(engine, warm[case], 2)
            results["packed-mtp", case] = burst(engine, prompts, args.new_tokens)
        del engine  # the last reference: the next engine sizes itself from the free memory
        free_memory()

    for case, prompts in bursts.items():
        count = sum(len(p) for p in prompts)
        entry: dict = {"prompt_tokens": count, "floor_s": 2 * params * count / FLOOR_FLOPS}
        for name in ("unpacked", "packed", "packed-mtp"):
            if (name, case) in results:
                entry[name] = {key: v for key, v in results[name, case].items() if key != "tokens"}
        entry["packed_equals_unpacked"] = results["packed", case]["tokens"] == results["unpacked", case]["tokens"]
        if args.k:
            entry["mtp_equals_plain"] = results["packed-mtp", case]["tokens"] == results["packed", case]["tokens"]
        report[f"ttft_{case}"] = entry
        print(f"TTFT {case}: unpacked {entry['unpacked']['ttft_mean_s'] * 1e3:8.1f} ms (max "
              f"{entry['unpacked']['ttft_max_s'] * 1e3:.1f}), packed {entry['packed']['ttft_mean_s'] * 1e3:8.1f} ms "
              f"(max {entry['packed']['ttft_max_s'] * 1e3:.1f}), floor {entry['floor_s'] * 1e3:.1f} ms; decode tok/s "
              f"{entry['unpacked']['decode_tokens_per_s']} vs {entry['packed']['decode_tokens_per_s']}; packed alone-"
              f"exact {entry['packed']['alone_exact']}, packed == unpacked {entry['packed_equals_unpacked']}"
              + (f", MTP == plain {entry['mtp_equals_plain']}" if args.k else ""))  # fmt: skip
    report["itl"] = {name: results[name, "itl"] for name in ("unpacked", "packed")}
    for name, itl in report["itl"].items():
        chunk, decode = itl["chunk_steps"], itl["decode_steps"]
        print(f"ITL {args.running} running + a {args.long}-token prompt every {args.interval} s, {name:8s}: "
              f"p50 {itl['p50_ms']:.1f} ms, p99 {itl['p99_ms']:.1f} ms, max {itl['max_ms']:.1f} ms; "
              f"{chunk['count']} chunk steps (mean {chunk.get('mean_ms', 0):.1f} ms), {decode['count']} decode "
              f"steps (mean {decode.get('mean_ms', 0):.1f} ms)")  # fmt: skip
        for part in ("chunk_step_gpu_ms", "decode_step_gpu_ms"):
            if part in itl:
                split = itl[part]
                kinds = "  ".join(f"{k} {v:.1f}" for k, v in split.items() if not isinstance(v, dict))
                print(f"  {name} {part}: " + kinds)
                for kernel, ms in split["top kernels"].items():
                    print(f"      {ms:9.2f} ms  {kernel}")
        if "chunk_step_host" in itl:
            host = itl["chunk_step_host"]
            print(f"  {name} chunk step under cProfile: {host['wall_ms']:.1f} ms wall; its host functions (own ms):")
            for function, ms in host["top functions"].items():
                print(f"      {ms:9.2f} ms  {function}")
            print(f"  {name} chunk step, host time by operator (torch profiler, self ms):")
            for op, ms in host["top ops"].items():
                print(f"      {ms:9.2f} ms  {op}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
