"""What several benchmark scripts share: waiting for the GPU before reading a clock, and reproducible random
prompts. Imported by the scripts as a sibling module (a script's directory is first on sys.path)."""

from __future__ import annotations

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
