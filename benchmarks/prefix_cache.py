"""Prefix caching on the GPU (issue #21), on one loaded model, caching on against off:
1. the time to first token of the 6th turn of a conversation whose history is ~`--history` tokens (five turns
   of a message and `--output` generated tokens, then a short 6th message); the cached engine ran turns 1-5
   (and the cache fills of their outputs) first, the uncached one prefills the whole 6th prompt;
2. 32 requests sharing a `--system`-token system prompt (each with its own 64-token question, 128 new tokens):
   wall time and generated tokens/s, with the system prompt cached by an earlier request ("warm") and with
   all 32 arriving on an empty cache ("cold": they are admitted together, so each computes it).
Every cached run's tokens are checked against the uncached run's (`exact`).
Usage (GPU box): python3 benchmarks/prefix_cache.py recipes/bench-27b.yaml [--k 0] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from bench_common import free_memory, sync, tokens  # (a sibling module: benchmarks/bench_common.py)

from qwen_mtp.engine import Engine, SamplingParams
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.recipe import load_recipe


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submit to the first generated token, and that token."""
    sync()
    start = time.perf_counter()
    rid = engine.submit(prompt, SamplingParams(1, ignore_eos=True))
    while not engine.requests[rid].done:
        engine.step()
    sync()
    return time.perf_counter() - start, engine.result(rid).token_ids[0]


def make_engine(recipe_path: str, loaded, caching: bool, k: int, extra: tuple[str, ...] = ()) -> Engine:
    sets = (f"cache.prefix_caching={str(caching).lower()}", "cache.max_batch=32", "cache.num_state_rows=32")
    sets += (("mtp.enabled=true", f"mtp.k={k}") if k else ("mtp.enabled=false",)) + extra
    engine = Engine.from_recipe(load_recipe(recipe_path, sets), loaded=loaded, log=print)
    engine.warmup()
    return engine


def conversation(engine: Engine, args, vocab: int) -> list[int]:
    """Run turns 1-5; returns the 6th turn's prompt."""
    history: list[int] = []
    message = (args.history - 5 * args.output) // 5
    for turn in range(5):
        prompt = history + tokens(message, seed=turn, vocab=vocab)
        history = prompt + engine.generate([prompt], max_new_tokens=args.output, ignore_eos=True)[0].token_ids
        drain(engine)  # the fill that caches this turn's output chunks (the user's think time)
    return history + tokens(64, seed=99, vocab=vocab)


def shared_system(engine: Engine, args, vocab: int, warm: bool) -> tuple[float, list[list[int]]]:
    system = tokens(args.system, seed=1000, vocab=vocab)
    prompts = [system + tokens(64, seed=2000 + i, vocab=vocab) for i in range(32)]
    if warm:
        engine.generate([system + tokens(64, seed=3000, vocab=vocab)], max_new_tokens=1, ignore_eos=True)
        drain(engine)
    sync()
    start = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens=128, ignore_eos=True)
    sync()
    return time.perf_counter() - start, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--k", type=int, default=0, help="MTP draft length (0: plain decode)")
    parser.add_argument("--history", type=int, default=4096)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefix-cache.json"))
    args = parser.parse_args()
    loaded = load_from_recipe(load_recipe(args.recipe))
    vocab = loaded.model.config.vocab_size
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report: dict = {"recipe": args.recipe, "device": device, "k": args.k}
    report |= {"history": args.history, "system": args.system}

    cached = make_engine(args.recipe, loaded, True, args.k)
    sixth = conversation(cached, args, vocab)
    first_token(cached, tokens(600, seed=7, vocab=vocab))  # prefill path warm at this length
    ttft_cached, token_cached = first_token(cached, sixth)
    stats = cached.stats()
    del cached
    free_memory()
    plain = make_engine(args.recipe, loaded, False, args.k)
    first_token(plain, tokens(600, seed=7, vocab=vocab))
    ttft_plain, token_plain = first_token(plain, sixth)
    report["turn6"] = dict(
        prompt=len(sixth), ttft_cached_s=ttft_cached, ttft_uncached_s=ttft_plain, exact=token_cached == token_plain,
        restored=stats["prefix_tokens_saved"],
    )  # fmt: skip
    speedup = ttft_plain / ttft_cached
    print(f"turn 6 ({len(sixth)}-token prompt): TTFT cached {ttft_cached * 1e3:.1f} ms, uncached "
          f"{ttft_plain * 1e3:.1f} ms ({speedup:.1f}x), exact {token_cached == token_plain}")  # fmt: skip

    seconds_plain, expected = shared_system(plain, args, vocab, warm=False)
    del plain
    free_memory()
    runs = {"uncached": seconds_plain}
    for warm in (True, False):
        cached = make_engine(args.recipe, loaded, True, args.k)
        seconds, got = shared_system(cached, args, vocab, warm)
        runs["warm" if warm else "cold"] = seconds
        report[f"system_{'warm' if warm else 'cold'}_exact"] = got == expected
        del cached
        free_memory()
    report["system_prompt"] = {name: dict(seconds=s, tokens_per_s=32 * 128 / s) for name, s in runs.items()}
    for name, s in runs.items():
        print(f"32 x ({args.system} shared + 64) tokens, 128 new: {name:8s} {s:7.2f} s  {32 * 128 / s:8.1f} tok/s")
    print(f"exact: warm {report['system_warm_exact']}, cold {report['system_cold_exact']}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
