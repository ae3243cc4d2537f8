"""The collectives a tensor-parallel step runs, as torch's functional collective ops (`_c10d_functional`):
`torch.compile` traces them, CUDA graphs capture them (NCCL on the current stream), and eagerly they are plain
calls. Gloo on CPU, NCCL on GPUs; never a home-made transport.

Exactness. The row-parallel partial sums of tp = 2 ranks are added once, `a + b`, the same bits on both ranks
whatever the batch. With more ranks an all-reduce's summation order depends on its algorithm and chunking,
which NCCL picks by message size, so a row could round differently in a 1-row decode and a (K+1)-row verify.
The decode path (`invariant`) therefore sums tp > 2 partial sums itself: an all-gather, then the adds in rank
order, the same for every row count. Prefill chunks (one request alone) take the all-reduce.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

_ops = torch.ops._c10d_functional


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup, invariant: bool = False) -> torch.Tensor:
    """The sum over the group's ranks of `x` (each rank's partial sum), identical on every rank."""
    if invariant and group.size() > 2:
        return sum_in_rank_order(x, group)
    return _ops.wait_tensor(_ops.all_reduce(x.contiguous(), "sum", group.group_name))


def sum_in_rank_order(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """`((x_0 + x_1) + x_2) + ...` over the ranks' `x`, elementwise: one summation order for every message size."""
    parts = all_gather(x, group)  # [tp, *x.shape]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's `x`, stacked in rank order: [tp, *x.shape]."""
    size = group.size()
    gathered = _ops.wait_tensor(_ops.all_gather_into_tensor(x.contiguous(), size, group.group_name))
    return gathered.view(size, *x.shape)
