"""The sharding plan: which rows or columns of each checkpoint tensor one tensor-parallel rank holds.

One table, by the tensor's Hugging Face name, serves the loader (each rank reads only its slices) and the docs
(docs/parallel.md draws the same layout):

| tensor | sharded along | a rank holds |
|---|---|---|
| `embed_tokens`, `lm_head` | rows (vocab) | V / tp consecutive token ids |
| GDN `in_proj_qkv`, `conv1d` | rows (channels) | its key heads' q and k channels and their value heads' v channels |
| GDN `in_proj_z` / `in_proj_b`, `in_proj_a`, `A_log`, `dt_bias` | rows | its value heads (dv rows / one row each) |
| GDN `out_proj` | columns | its value heads' channels (row-parallel: partial sums, all-reduced) |
| attention `q_proj` | rows | its query heads (each head's q and gate rows) |
| attention `k_proj`, `v_proj` | rows | its KV heads, or the one KV head its query heads share (replicated) |
| attention `o_proj` | columns | its query heads' channels (row-parallel) |
| MLP `gate_proj`, `up_proj` / `down_proj` | rows / columns | I / tp intermediate channels (down: row-parallel) |
| MoE `experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] | dim 1 / dim 2 | I / tp of each expert's gate, up |
| MoE per-expert `experts.{e}.gate_proj`, `up_proj` / `down_proj` | rows / columns | the same slices |
| MoE `shared_expert.gate_proj`, `up_proj` / `down_proj` | rows / columns | I_shared / tp channels |
| Qwen3-Next `in_proj_qkvz`, `in_proj_ba` | rows | its key heads' row groups (q, k, v, z / b, a of a key head) |
| norms, `q_norm`, `k_norm`, GDN `norm`, `mtp.fc`, `mtp.pre_fc_norm_*`, the MoE router | - | replicated |

Rank r holds the r-th block of every sharded dimension, so shards follow token ids and head order. Qwen3-Next's
interleaved projections group their rows by key head, so a rank's key heads are one contiguous block of rows there
too, which the rank's own (smaller) mixer permutes into the fused layout as the whole model does
(`model/next_layout.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from qwen_mtp.config import ModelConfig
from qwen_mtp.model.shapes import RankShapes

ROW_PARALLEL = ("o_proj", "out_proj", "down_proj")  # linears whose output is a partial sum over ranks
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class TensorShard:
    """The part of a checkpoint tensor one rank holds: the index ranges `ranges` ([start, stop) pairs) along
    `dim`, concatenated in order (a GDN `in_proj_qkv` shard is three ranges: its q, k and v channels), of the
    `full` indices the whole tensor has there."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int
    ndim: int = 2  # the tensor's dimensions: 3 for the MoE experts' stacked weights [E, N, K]

    @property
    def matrix_axis(self) -> int:
        """0 when the shard splits the matrix's rows (N), 1 its columns (K): the axis of its block scales."""
        return self.dim - self.ndim + 2

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def read(self, tensor_slice) -> torch.Tensor:
        """This shard from a safetensors `get_slice` handle (or a tensor): only its ranges are read."""
        index = (slice(None),) * self.dim
        parts = [tensor_slice[(*index, slice(start, stop))] for start, stop in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def blocks(self, block: int) -> TensorShard | None:
        """The same shard of a block-scale tensor (one scale per `block` indices along `dim`); None when a range
        does not start and end on a block boundary (the tensor's end excepted), so that a block's scale would
        straddle two ranks."""
        if any(start % block or (stop % block and stop != self.full) for start, stop in self.ranges):
            return None
        ranges = tuple((start // block, -(-stop // block)) for start, stop in self.ranges)
        return TensorShard(self.dim, ranges, -(-self.full // block), self.ndim)


class ShardPlan:
    """The plan for rank `rank` of `tp` over a model of `config` (`RankShapes.of` checks that `tp` divides it)."""

    def __init__(self, config: ModelConfig, tp: int, rank: int):
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is not one of the {tp} ranks")
        self.config, self.tp, self.rank = config, tp, rank
        self.shapes = s = RankShapes.of(config, tp)
        self.vocab = self._block(s.vocab_size)
        key_heads, value_heads = self._block(s.gdn_key_dim), self._block(s.gdn_value_dim)
        total_key = config.linear_num_key_heads * config.linear_key_head_dim
        qkv = (key_heads, _shift(key_heads, total_key), _shift(value_heads, 2 * total_key))
        heads = self._block(s.heads * s.head_dim)
        kv_head = rank * config.num_key_value_heads // tp if config.num_key_value_heads < tp else rank
        kv = (kv_head * s.kv_heads * s.head_dim, (kv_head + 1) * s.kv_heads * s.head_dim)
        mlp = self._block(s.intermediate_size)
        c, rows, cols = config, 0, 1
        value_rows = self._block(s.gdn_value_heads)
        self._table: dict[str, TensorShard] = {
            "embed_tokens.weight": TensorShard(rows, (self.vocab,), c.vocab_size),
            "lm_head.weight": TensorShard(rows, (self.vocab,), c.vocab_size),
            "linear_attn.in_proj_qkv.weight": TensorShard(rows, qkv, 2 * total_key + s.gdn_value_dim * tp),
            "linear_attn.conv1d.weight": TensorShard(rows, qkv, 2 * total_key + s.gdn_value_dim * tp),
            "linear_attn.in_proj_z.weight": TensorShard(rows, (value_heads,), s.gdn_value_dim * tp),
            "linear_attn.in_proj_b.weight": TensorShard(rows, (value_rows,), c.linear_num_value_heads),
            "linear_attn.in_proj_a.weight": TensorShard(rows, (value_rows,), c.linear_num_value_heads),
            "linear_attn.A_log": TensorShard(rows, (value_rows,), c.linear_num_value_heads),
            "linear_attn.dt_bias": TensorShard(rows, (value_rows,), c.linear_num_value_heads),
            "linear_attn.out_proj.weight": TensorShard(cols, (value_heads,), s.gdn_value_dim * tp),
            "self_attn.q_proj.weight": TensorShard(
                rows, (self._block(2 * s.heads * s.head_dim),), 2 * s.heads * s.head_dim * tp
            ),
            "self_attn.k_proj.weight": TensorShard(rows, (kv,), c.num_key_value_heads * c.head_dim),
            "self_attn.v_proj.weight": TensorShard(rows, (kv,), c.num_key_value_heads * c.head_dim),
            "self_attn.o_proj.weight": TensorShard(cols, (heads,), s.heads * s.head_dim * tp),
            "mlp.gate_proj.weight": TensorShard(rows, (mlp,), c.intermediate_size),
            "mlp.up_proj.weight": TensorShard(rows, (mlp,), c.intermediate_size),
            "mlp.down_proj.weight": TensorShard(cols, (mlp,), c.intermediate_size),
        }
        if c.moe is not None:
            expert, full = self._block(s.expert_intermediate_size), c.moe.intermediate_size
            shared, full_shared = self._block(s.shared_expert_intermediate_size), c.moe.shared_intermediate_size
            self._table |= {
                "mlp.experts.gate_up_proj": TensorShard(1, (expert, _shift(expert, full)), 2 * full, ndim=3),
                "mlp.experts.down_proj": TensorShard(2, (expert,), full, ndim=3),
                "mlp.experts.*.gate_proj.weight": TensorShard(rows, (expert,), full),
                "mlp.experts.*.up_proj.weight": TensorShard(rows, (expert,), full),
                "mlp.experts.*.down_proj.weight": TensorShard(cols, (expert,), full),
                "mlp.shared_expert.gate_proj.weight": TensorShard(rows, (shared,), full_shared),
                "mlp.shared_expert.up_proj.weight": TensorShard(rows, (shared,), full_shared),
                "mlp.shared_expert.down_proj.weight": TensorShard(cols, (shared,), full_shared),
            }
        if c.interleaved_gdn_projections:  # Qwen3-Next: rows grouped by key head (next_layout.py)
            group_heads = c.linear_num_value_heads // c.linear_num_key_heads  # value heads a key head serves
            qkvz = 2 * c.linear_key_head_dim + 2 * group_heads * c.linear_value_head_dim  # rows of one group
            self._table |= {
                "linear_attn.in_proj_qkvz.weight": TensorShard(
                    rows, (self._block(s.gdn_key_heads * qkvz),), c.linear_num_key_heads * qkvz
                ),
                "linear_attn.in_proj_ba.weight": TensorShard(
                    rows, (self._block(s.gdn_key_heads * 2 * group_heads),), c.linear_num_value_heads * 2
                ),
            }

    def _block(self, size: int) -> tuple[int, int]:
        """This rank's block of a dimension that holds `size` indices per rank."""
        return self.rank * size, (self.rank + 1) * size

    def shard(self, name: str) -> TensorShard | None:
        """The shard of checkpoint tensor `name` (text-layout HF name) this rank holds; None: it is replicated."""
        if self.tp == 1:
            return None
        name = _EXPERT_INDEX.sub(".experts.*.", name)  # one entry for every expert's per-expert tensors
        for suffix, shard in self._table.items():
            if name == suffix or name.endswith("." + suffix):
                return shard
        return None


def _shift(block: tuple[int, int], offset: int) -> tuple[int, int]:
    return block[0] + offset, block[1] + offset
