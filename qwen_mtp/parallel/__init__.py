"""Tensor parallelism through torch.distributed: the sharding plan, the collectives, the transformation of the
plain model, and starting the ranks (see docs/parallel.md)."""

from qwen_mtp.parallel.group import TensorParallel, current
from qwen_mtp.parallel.plan import ShardPlan, TensorShard

__all__ = ["ShardPlan", "TensorParallel", "TensorShard", "current"]
