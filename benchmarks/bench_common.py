"""What several benchmark scripts share: waiting for the GPU before reading a clock, reproducible random
prompts, and freeing a dropped engine's memory. Imported by the scripts as a sibling module (a script's
directory is first on sys.path)."""

from __future__ import annotations

import gc
import random

import torch


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
