"""Where a long prompt's time to first token goes (issue #24): one request, prompt of `--length` tokens, for
each `cache.prefill_chunk` in `--chunks`: the wall time from submit to the first token (every chunk, then the
first token), against the compute floor (2 x parameters FLOPs per token at the H200's measured dense bf16 rate),
then one profiled run per chunk size with the GPU time split into the weight GEMMs, prefill attention, the GDN
kernels and the rest.
Usage (GPU box): python3 benchmarks/long_prefill.py recipes/bench-27b.yaml [--length 32768] [--chunks 512 2048 8192]
    [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench_common import gpu_split, sync  # (a sibling module: benchmarks/bench_common.py)

from qwen_mtp.engine import Engine, SamplingParams
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.recipe import load_recipe

DENSE_BF16_TFLOPS = 700.0  # what cuBLAS reaches on large bf16 GEMMs on this H200 (docs/benchmark-log.md)


def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submit to the first generated token, and the number of engine steps it took."""
    rid = engine.submit(prompt, SamplingParams(1, ignore_eos=True))
    sync()
    start, steps = time.perf_counter(), 0
    while not engine.requests[rid].done:
        engine.step()
        steps += 1
    sync()
    return time.perf_counter() - start, steps


def profiled(engine: Engine, prompt: list[int]) -> dict:
    """GPU milliseconds per kernel category over one whole prefill."""
    return gpu_split(lambda: time_to_first_token(engine, prompt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "long-prefill.json"))
    args = parser.parse_args()
    base = load_recipe(args.recipe, ("compile.cuda_graphs=false", "mtp.enabled=false"))
    loaded = load_from_recipe(base)
    params = sum(p.numel() for p in loaded.model.parameters())
    floor_s = 2 * params * args.length / (DENSE_BF16_TFLOPS * 1e12)
    vocab = loaded.model.config.vocab_size
    prompt = [(100 + i * 7919) % vocab for i in range(args.length)]
    report = dict(length=args.length, params=params, floor_s=floor_s, runs={})
    print(f"{args.length}-token prompt, {params / 1e9:.2f} B parameters; compute floor (weights only, "
          f"{DENSE_BF16_TFLOPS:.0f} TFLOP/s) {floor_s:.2f} s")  # fmt: skip
    for chunk in args.chunks:
        pages = -(-(args.length + 64) // base.cache.page_size) + 8
        recipe = load_recipe(
            args.recipe, ("compile.cuda_graphs=false", "mtp.enabled=false", f"cache.prefill_chunk={chunk}",
                          f"cache.num_pages={pages}", "cache.max_batch=1"),
        )  # fmt: skip
        engine = Engine.from_recipe(recipe, loaded=loaded, log=lambda *a: None)
        time_to_first_token(engine, prompt[: 2 * chunk])  # JIT and allocator warm-up at this chunk size
        seconds, steps = time_to_first_token(engine, prompt)
        run = dict(ttft_s=seconds, steps=steps, vs_floor=seconds / floor_s)
        if not args.no_profile:
            run["gpu_ms"] = profiled(engine, prompt)
        report["runs"][chunk] = run
        split = "  ".join(f"{k} {v / 1e3:.2f} s" for k, v in run.get("gpu_ms", {}).items() if not isinstance(v, dict))
        print(f"chunk {chunk:5d}: TTFT {seconds:6.2f} s ({steps} steps, {seconds / floor_s:.2f}x floor)  {split}",
              flush=True)  # fmt: skip
        for name, ms in run.get("gpu_ms", {}).get("top kernels", {}).items():
            print(f"      {ms:9.1f} ms  {name}")
        del engine
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
