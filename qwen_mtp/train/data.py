"""Batches of token windows from the train stream, a pure function of (seed, step), so resuming at a step
continues the data exactly where it stopped."""

from __future__ import annotations

import torch


class Windows:
    """Non-overlapping windows of `seq_len + 2` tokens (input, next-token labels and the MTP's t+2 labels), each
    starting `seq_len` after the last. Epoch e visits them in the permutation drawn from (seed, e)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.count = (len(tokens) - 2) // seq_len
        if self.count < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens: fewer than one window of {seq_len + 2}")
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.count, generator=generator)
        return self._order

    def batch(self, step: int) -> torch.Tensor:
        """Step `step`'s windows, int64 [batch_size, seq_len + 2]."""
        rows = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            start = int(self._permutation(i // self.count)[i % self.count]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 2])
        return torch.stack(rows).long()

    def epochs(self, steps: int) -> float:
        return steps * self.batch_size / self.count
