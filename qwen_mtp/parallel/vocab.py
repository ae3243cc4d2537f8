"""The vocab-parallel embedding and the greedy choice over a vocab-parallel lm_head.

Rank r holds token ids [r V/tp, (r+1) V/tp) of the embedding (and of the lm_head, or the tied embedding). A
lookup reads the rows this rank holds, zeros the others and sums over ranks: one exact add of a row and zeros.
The lm_head gives each rank the logits of its ids only; the token is chosen without gathering them: each rank's
(largest logit, its id) pair is all-gathered and the largest wins, ties going to the lowest id, as
`torch.argmax` breaks them (a rank's own argmax picks its lowest id, and ranks are in id order). A draft
vocabulary's ids split the same way: each rank scores the ones in its shard (possibly none). A step that samples,
penalizes or reports logprobs gathers the whole rows instead (`VocabShard.gather`: V/tp logits a row from each rank)
and every rank runs the single-device sampler on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from qwen_mtp.parallel.collectives import all_gather, all_reduce_sum


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` over this rank's rows `weight` [V/tp, H] of the vocabulary, which start at id `start`."""

    def __init__(self, weight: nn.Parameter, start: int, group: ProcessGroup):
        super().__init__()
        self.weight, self.start, self.group = weight, start, group

    def extra_repr(self) -> str:
        rows, hidden = self.weight.shape
        return f"ids [{self.start}, {self.start + rows}) of the vocabulary, hidden {hidden}"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return all_reduce_sum(rows.masked_fill(elsewhere[..., None], 0.0), self.group)


class VocabShard:
    """This rank's part of the lm_head's vocabulary (ids from `start`), and the greedy choice across ranks."""

    def __init__(self, start: int, group: ProcessGroup):
        self.start, self.group = start, group

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits [..., V] from every rank's shard [..., V/tp] (ranks hold consecutive ids):
        what sampling, penalties and logprobs need. Every rank gets the same tensor, so every rank's sampler makes
        the same choice."""
        return torch.cat(all_gather(logits, self.group).unbind(0), dim=-1)

    def argmax(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Global token ids [...] of the largest logit, for this rank's logits [..., n] (fp32): its whole shard
        (n = V/tp, column i is id start + i), or the ascending global ids `ids` [n] of this rank's part of a draft
        vocabulary (`DraftLmHead`), which may be empty (n = 0: this rank offers nothing)."""
        if logits.shape[-1] == 0:
            value = logits.new_full(logits.shape[:-1], float("-inf"))
            chosen = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        else:
            index = logits.argmax(dim=-1)  # the first maximum: this rank's lowest id among ties
            value = logits.gather(-1, index[..., None])[..., 0]
            chosen = index + self.start if ids is None else ids[index]
        # One collective for both: fp32 values and ids below 2^53 are exact in float64.
        pairs = all_gather(torch.stack([value.double(), chosen.double()], dim=-1), self.group)
        best = pairs[..., 0].argmax(dim=0, keepdim=True)  # the first rank with the maximum: the lowest id
        return torch.gather(pairs[..., 1], 0, best)[0].long()
