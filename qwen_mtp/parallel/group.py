"""A tensor-parallel rank: its index, the degree, its device, and the process group its collectives run over.

The ranks are started by `launch.py` (or torchrun); inside one, `current(tp)` is that rank's `TensorParallel`.
The group's timeout bounds every collective, so a rank whose peer died or hangs raises instead of waiting
forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from qwen_mtp.errors import RecipeError


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    degree: int
    local_rank: int  # the rank's index on its machine: its CUDA device
    group: ProcessGroup | None  # None: the shard's weights without collectives (loader tests, tools)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (a host round trip: for agreeing on sizes at startup, e.g. the KV
        pool, which on a GPU depends on each device's free memory and must be the same on every rank)."""
        if self.group is None:
            return value
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


def current(tp: int) -> TensorParallel | None:
    """This process's rank of a `tp`-way tensor-parallel group (None for tp = 1); a RecipeError when the ranks
    were not started."""
    if tp == 1:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise RecipeError(
            f"parallel.tp={tp} needs {tp} ranks: run through `qwen-mtp run` / `qwen-mtp bench` (which start them) "
            f"or `torchrun --nproc-per-node {tp}`"
        )
    world = dist.get_world_size()
    if world != tp:
        raise RecipeError(f"parallel.tp={tp} but {world} ranks were started: start exactly {tp}")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return TensorParallel(rank, tp, local_rank, dist.group.WORLD)
