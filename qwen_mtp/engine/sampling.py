"""Which token a step emits, and which drafts a verify accepts: the one place both rules live, on the device.

Greedy: the token at a position is the argmax of its fp32 logits (the first maximal index, as Hugging Face's
greedy search picks). A verify over `[t_n, d1..dK]` chooses `c_0..c_K`; draft `d_i` is accepted while every
draft before it was, and `d_i == c_{i-1}`. The request then emits `c_0..c_j` (j accepted drafts, then the
bonus `c_j`): the accepted drafts equal the chosen tokens, so the emitted tokens are always the chosen ones and
MTP-on gives exactly MTP-off's tokens. Both are functions of device tensors, with no host read, so a verify,
its acceptance, the state commit and the next draft run back to back on the GPU.

Under tensor parallelism the logits are the rank's vocabulary shard and `shard` (the model's `vocab_shard`)
takes the argmax across the ranks, breaking ties to the lowest id as `argmax` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qwen_mtp.parallel.vocab import VocabShard


def choose(logits: torch.Tensor, shard: VocabShard | None = None) -> torch.Tensor:
    """The emitted token ids [...] for logits [..., V] (or a vocab-parallel rank's [..., V/tp] and its `shard`)."""
    if shard is not None:
        return shard.argmax(logits.float())
    return logits.float().argmax(dim=-1)


def accept(drafts: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request [B] (long) for `drafts` [B, K] and the verify's chosen tokens [B, K+1]:
    the length of the prefix where `drafts[:, i] == chosen[:, i]`."""
    matches = drafts == chosen[:, : drafts.shape[1]]
    return matches.long().cumprod(dim=1).sum(dim=1)
