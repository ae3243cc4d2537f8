"""Where a decode step's GPU time goes: runs a few eager plain-decode (or verify) steps of a recipe's model under
`torch.profiler` and prints the kernels by total GPU time per step, next to the step's wall time eagerly and
under CUDA graphs. Usage (GPU box): python3 benchmarks/profile_step.py recipes/bench-27b.yaml [--k 2]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from qwen_mtp.engine.engine import Engine
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.recipe import load_recipe


def decode_ms(engine: Engine, prompt: list[int], steps: int) -> float:
    """Wall ms per decode step after the prefill (prompt prefilled in the first step)."""
    rid = engine.submit(prompt, steps + 2, ignore_eos=True)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, ("compile.cuda_graphs=false", "compile.enabled=false", "cache.num_pages=64"))
    loaded = load_from_recipe(recipe)
    prompt = list(range(100, 228))
    eager = Engine(loaded, recipe, log=print)
    print(f"eager decode: {decode_ms(eager, prompt, 16):.2f} ms/step")
    eager.submit(prompt, args.steps + 2, ignore_eos=True)
    eager.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eager.step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0) > 0:
            entry = totals[event.key[:90]]
            entry[0] += event.self_device_time_total / args.steps
            entry[1] += event.count // args.steps
    gpu_us = sum(v[0] for v in totals.values())
    print(f"GPU kernel time per step: {gpu_us / 1e3:.2f} ms over {sum(v[1] for v in totals.values())} kernels")
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{us:9.1f} us {count:6d}x  {us / max(count, 1):7.2f} us/kernel  {name}")
    del eager
    graphed = Engine(loaded, load_recipe(args.recipe, ("compile.cuda_graphs=true", "cache.num_pages=64")), log=print)
    graphed.warmup()
    print(f"CUDA-graph decode: {decode_ms(graphed, prompt, 32):.2f} ms/step")


if __name__ == "__main__":
    main()
