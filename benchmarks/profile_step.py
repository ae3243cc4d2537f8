"""Where a decode step's GPU time goes: runs a few eager plain-decode (or verify) steps of a recipe's model under
`torch.profiler` and prints the kernels by total GPU time per step, next to the step's wall time eagerly and
under CUDA graphs; with `--prefill N`, one N-token prefill instead (wall time and kernels).
Usage (GPU box): python3 benchmarks/profile_step.py recipes/bench-27b.yaml [--prefill 2048]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    args = parser.parse_args()
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
