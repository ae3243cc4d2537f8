"""Where a decode step's GPU time goes: runs a few eager plain-decode (or verify) steps of a recipe's model under
`torch.profiler` and prints the kernels by total GPU time per step, next to the step's wall time eagerly and
under CUDA graphs; with `--prefill N`, one N-token prefill instead (wall time and kernels).
`--graphed B [B ...]`: instead, B requests at once under CUDA graphs (as the bench runs them), plain and with
`--k K` drafts a step (the random head's drafts are rejected, but a verify costs what it costs), each step's
kernels split by kind (GEMM, GDN, attention, other) with the top kernels.
Usage (GPU box): python3 benchmarks/profile_step.py recipes/bench-27b.yaml [--prefill 2048]
                 python3 benchmarks/profile_step.py recipes/bench-27b.yaml --graphed 1 32 --k 3 [--out PATH]
                     [--set model.synthetic=qwen3.5-27b-fp8]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from qwen_mtp.engine import Engine, SamplingParams
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.recipe import load_recipe


def decode_ms(engine: Engine, prompt: list[int], steps: int) -> float:
    """Wall ms per decode step after the prefill (prompt prefilled in the first step)."""
    rid = engine.submit(prompt, SamplingParams(steps + 2, ignore_eos=True))
    engine.step()
    engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    count = 0
    while not engine.requests[rid].done:
        engine.step()
        count += 1
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / count


def print_kernels(prof, steps: int, top: int) -> None:
    """The profiled kernels by GPU time per step."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0) > 0:
            entry = totals[event.key[:90]]
            entry[0] += event.self_device_time_total / steps
            entry[1] += event.count // steps
    gpu_us = sum(v[0] for v in totals.values())
    print(f"GPU kernel time per step: {gpu_us / 1e3:.2f} ms over {sum(v[1] for v in totals.values())} kernels")
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us:9.1f} us {count:6d}x  {us / max(count, 1):7.2f} us/kernel  {name}")


def profile_prefill(loaded, recipe, length: int, top: int) -> None:
    """Wall time of one `length`-token prefill (the step that consumes the prompt), then its kernels."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    engine = Engine.from_recipe(recipe, loaded=loaded, log=print)
    prompt = [100 + i % 1000 for i in range(length)]
    for attempt in range(3):  # the first run includes Triton JIT / caching allocator growth
        engine.submit(prompt, SamplingParams(1, ignore_eos=True))
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        print(f"prefill {length} tokens, run {attempt}: {1e3 * (time.perf_counter() - start):.1f} ms")
        while engine.has_unfinished():
            engine.step()
    engine.submit(prompt, SamplingParams(1, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync()
    print_kernels(prof, 1, top)


def profile_graphed(
    recipe_path: str, batches: list[int], k: int, steps: int, out: str | None, extra: tuple[str, ...] = ()
) -> None:
    """B requests decoding together under CUDA graphs (one engine per batch size and mode, sized as the bench sizes
    them), plain and (k > 0) MTP with k drafts: wall ms per engine step and the profiled kernels of `steps` steps
    split by kind, per step."""
    import json

    from bench_common import free_memory, gpu_split

    loaded, report = None, {}
    for mode_k in [0] + ([k] if k else []):
        for batch in batches:
            budget = batch + 8 + 3 * steps  # tokens a request may make: its batch's prefill steps, warm-up, timed
            pages = batch * (-(-(128 + budget + 2 * mode_k) // 64) + 1)
            settings = [
                "compile.cuda_graphs=true", f"compile.batch_sizes=[{batch}]", f"cache.max_batch={batch}",
                f"cache.num_state_rows={batch}", f"cache.num_pages={pages}",
                f"mtp.enabled={'true' if mode_k else 'false'}", f"mtp.k={mode_k or 1}", *extra,
            ]  # fmt: skip
            recipe = load_recipe(recipe_path, settings)
            loaded = loaded or load_from_recipe(recipe)
            engine = Engine.from_recipe(recipe, loaded=loaded, log=lambda *_: None)
            engine.warmup()
            prompts = [[100 + (7 * i + j) % 1000 for j in range(128)] for i in range(batch)]
            for p in prompts:
                engine.submit(p, SamplingParams(budget, ignore_eos=True))

            def run_steps(count: int, engine=engine) -> None:
                for _ in range(count):
                    engine.step()

            run_steps(batch + 4)  # every prompt prefilled (a chunk a step at most), then decoding
            torch.cuda.synchronize()
            start = time.perf_counter()
            run_steps(steps)
            torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - start) / steps
            split = gpu_split(functools.partial(run_steps, steps), top=16)
            per_step = {key: (v / steps if not isinstance(v, dict) else {n: t / steps for n, t in v.items()})
                        for key, v in split.items()}  # fmt: skip
            label = f"B{batch} " + (f"K={mode_k} verify+draft" if mode_k else "plain")
            report[label] = dict(wall_ms=wall, gpu_ms=per_step)
            kinds = "  ".join(f"{kind} {ms:.2f}" for kind, ms in per_step.items() if not isinstance(ms, dict))
            print(f"{label}: {wall:.2f} ms a step (wall); GPU ms a step: {kinds}", flush=True)
            for name, ms in per_step["top kernels"].items():
                launches = per_step["launches"][name]
                print(f"    {ms * 1e3:8.1f} us  {launches:5.0f}x {ms * 1e3 / max(launches, 1):6.2f} us  {name}")
            del engine, run_steps
            free_memory()
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    parser.add_argument("--graphed", type=int, nargs="*", default=None, help="batch sizes to profile under graphs")
    parser.add_argument("--k", type=int, default=0, help="with --graphed: also MTP with this many drafts")
    parser.add_argument("--out", default=None, help="with --graphed: write the split here as JSON")
    parser.add_argument("--set", action="append", default=[], help="with --graphed: a recipe override (repeatable)")
    args = parser.parse_args()
    if args.graphed:
        profile_graphed(args.recipe, args.graphed, args.k, args.steps, args.out, tuple(args.set))
        return
    chunk = (f"cache.prefill_chunk={args.prefill}",) if args.prefill else ()
    eager_settings = ("compile.cuda_graphs=false", "compile.enabled=false", "cache.num_pages=64", *chunk)
    recipe = load_recipe(args.recipe, eager_settings)
    loaded = load_from_recipe(recipe)
    prompt = list(range(100, 228))
    if args.prefill:
        profile_prefill(loaded, recipe, args.prefill, args.top)
        return
    eager = Engine.from_recipe(recipe, loaded=loaded, log=print)
    print(f"eager decode: {decode_ms(eager, prompt, 16):.2f} ms/step")
    eager.submit(prompt, SamplingParams(args.steps + 2, ignore_eos=True))
    eager.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eager.step()
        torch.cuda.synchronize()
    print_kernels(prof, args.steps, args.top)
    del eager
    graphed_recipe = load_recipe(args.recipe, ("compile.cuda_graphs=true", "cache.num_pages=64"))
    graphed = Engine.from_recipe(graphed_recipe, loaded=loaded, log=print)
    graphed.warmup()
    print(f"CUDA-graph decode: {decode_ms(graphed, prompt, 32):.2f} ms/step")


if __name__ == "__main__":
    main()
