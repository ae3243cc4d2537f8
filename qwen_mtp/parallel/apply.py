"""Tensor parallelism as a transformation of the plain model (as gpt-fast's tp.py): a model built with the
rank's shapes (`QwenHybridForCausalLM(config, tp)`) and loaded with the rank's slices gains its collectives
here, and nothing else changes. At tp = 1 this never runs: that model has no collective at all."""

from __future__ import annotations

from torch.distributed import ProcessGroup

from qwen_mtp.model import Linear, QwenHybridForCausalLM
from qwen_mtp.model.moe import SparseMoeBlock
from qwen_mtp.parallel.collectives import all_reduce_sum
from qwen_mtp.parallel.group import TensorParallel
from qwen_mtp.parallel.plan import ROW_PARALLEL, ShardPlan
from qwen_mtp.parallel.vocab import VocabParallelEmbedding, VocabShard


def apply_tensor_parallel(model: QwenHybridForCausalLM, parallel: TensorParallel) -> QwenHybridForCausalLM:
    """Sum the row-parallel linears' (and MoE blocks') partial outputs over the ranks, make the embedding
    vocab-parallel, and give the lm_head's greedy choice its cross-rank argmax (`model.vocab_shard`). In place;
    returns `model`."""
    if model.shapes.tp != parallel.degree:
        raise ValueError(f"model built for tp={model.shapes.tp}, rank of a {parallel.degree}-way group")
    if parallel.group is None:
        raise ValueError("apply_tensor_parallel needs the ranks' process group")
    start = ShardPlan(model.config, parallel.degree, parallel.rank).vocab[0]
    moe_blocks: list[str] = []  # named_modules() yields a block before anything inside it
    for name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):  # one sum of the whole block's output (moe.py)
            module.reduce = _summed_over(parallel.group)
            moe_blocks.append(name + ".")
        elif isinstance(module, Linear) and name.rpartition(".")[2] in ROW_PARALLEL:
            if not name.startswith(tuple(moe_blocks)):  # not the shared expert's down_proj: its block sums
                module.reduce = _summed_over(parallel.group)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens.weight, start, parallel.group)
    model.vocab_shard = VocabShard(start, parallel.group)
    model.parallel = parallel
    return model


def _summed_over(group: ProcessGroup):
    def reduce(partial, invariant: bool):
        return all_reduce_sum(partial, group, invariant)

    return reduce
