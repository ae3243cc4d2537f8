"""What several benchmark scripts share: waiting for the GPU before reading a clock, reproducible random
prompts, freeing a dropped engine's memory, and a profile's GPU time by kind of kernel. Imported by the scripts
as a sibling module (a script's directory is first on sys.path)."""

from __future__ import annotations

import cProfile
import gc
import pstats
import random
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = (  # kernel-name fragments -> category (first match wins)
    ("attention", ("attention", "flash", "attn", "sdpa")),
    ("gdn", ("gdn", "delta", "chunk", "conv", "gated")),
    ("gemm", ("gemm", "matmul", "cutlass", "sm90", "xmma", "nvjet", "linear")),
)
GDN_KERNELS = {"decay_kkt", "invert", "wy", "states", "output"}  # ops/gdn/chunked.py's kernels, by exact name


def sync() -> None:
    """Wait for the GPU's queued work (no-op on CPU), so a wall-clock reading covers it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    """n random token ids in [100, vocab), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def free_memory() -> None:
    """After `del engine` (every reference to it): free its pools before the next engine sizes itself from the
    free memory. An engine's callbacks form reference cycles, so dropping the name alone frees nothing: collect
    them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kind(name: str) -> str:
    """A kernel's category for `gpu_split`: attention, gdn, gemm or other."""
    low = name.lower()
    if low in GDN_KERNELS:
        return "gdn"
    for label, keys in KINDS:
        if any(key in low for key in keys):
            return label
    return "other"


def gpu_split(fn, top: int = 12) -> dict:
    """Device milliseconds of one call of `fn` per kernel category, its `top` kernels by name, and how many times
    each of those ran ("launches"; on CPU: the ops' CPU time and calls, the profiler's only device there)."""
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    totals: dict = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total" if on_gpu else "self_cpu_time_total", 0)
        if us > 0:
            totals[kind(event.key)] += us / 1e3
            kernels[event.key[:80]] += us / 1e3
            counts[event.key[:80]] += event.count
    totals["top kernels"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top])
    totals["launches"] = {name: counts[name] for name in totals["top kernels"]}
    return dict(totals)


def host_split(fn, top: int = 25) -> dict:
    """Wall milliseconds of one call of `fn` (the GPU waited for), and the host functions that took the most of
    it under cProfile (their own time, `tottime`, in ms; cProfile's overhead inflates them all alike). A step
    whose wall time is well above its GPU time is bound by these: the GPU waits for the host's launches."""
    sync()
    started = time.perf_counter()
    with cProfile.Profile() as prof:
        fn()
        sync()
    wall = time.perf_counter() - started
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    functions = {f"{name} ({file.rsplit('/', 1)[-1]}:{line}) x{calls}": 1e3 * tottime
                 for (file, line, name), (calls, _, tottime, _, _) in ranked}  # fmt: skip
    return {"wall_ms": 1e3 * wall, "top functions": functions}


def cpu_split(fn, top: int = 20) -> dict:
    """Host milliseconds of one call of `fn` by operator, as torch's profiler records them on the CPU (each
    op's self time, C++ included: the dispatcher, allocations, kernel launches), its `top` entries."""
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    ranked = sorted(prof.key_averages(), key=lambda event: -event.self_cpu_time_total)[:top]
    return {f"{event.key[:70]} x{event.count}": event.self_cpu_time_total / 1e3 for event in ranked}
