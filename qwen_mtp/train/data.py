"""Batches of token windows from the train stream, a pure function of (seed, step), so resuming at a step
continues the data exactly where it stopped."""

from __future__ import annotations

import torch

from qwen_mtp.errors import RecipeError


class Windows:
    """Windows of `seq_len + extra` tokens (the inputs, then the labels the losses read further ahead: 1 for the
    next token, 1 per MTP draft step), each starting `seq_len` after the last. Epoch e visits them in the
    permutation drawn from (seed, e)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, extra: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.extra, self.batch_size, self.seed = tokens, seq_len, extra, batch_size, seed
        self.count = (len(tokens) - extra) // seq_len
        if self.count < 1:
            raise RecipeError(
                f"the corpus has {len(tokens)} train tokens: fewer than one window of {seq_len + extra} "
                "(add files to the corpus or lower train.seq_len)"
            )
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.count, generator=generator)
        return self._order

    def batch(self, step: int) -> torch.Tensor:
        """Step `step`'s windows, int64 [batch_size, seq_len + extra]."""
        rows = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            start = int(self._permutation(i // self.count)[i % self.count]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + self.extra])
        return torch.stack(rows).long()

    def epochs(self, steps: int) -> float:
        return steps * self.batch_size / self.count
