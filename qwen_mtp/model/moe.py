"""The sparse MoE MLP of Qwen3.5-MoE and Qwen3-Next: a softmax top-k router, the routed SwiGLU experts and a
shared expert scaled by a sigmoid gate:

    weights, ids = top-k of softmax(gate(x)) (renormalised)          # qwen_mtp::moe_route
    out = sum_j weights_j * expert_{ids_j}(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)   # qwen_mtp::moe

The experts are stored as Hugging Face's model holds them, two 3-D weights per layer (`experts.gate_up_proj`
[E, 2I, H], gate rows then up rows; `experts.down_proj` [E, H, I]); checkpoints that store one tensor per
expert (`experts.{e}.gate_proj.weight`, ...) load into their slices (`Experts.checkpoint_aliases`). FP8 block
experts stay e4m3 with their block scales, computed by the same kernels (W8A16, `ops/moe.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from qwen_mtp.config import MoeConfig
from qwen_mtp.model.layers import MLP
from qwen_mtp.model.linear import MergedLinear, _copy_into, _init_like_nn_linear
from qwen_mtp.model.weights import WeightSlot
from qwen_mtp.ops.moe import moe, moe_route
from qwen_mtp.quant.fp8 import FP8_BLOCK, quantize_fp8_block, scale_grid

PER_EXPERT = ("gate_proj", "up_proj", "down_proj")  # the per-expert checkpoint tensors, in HF's names
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # the 3-D weights; FP8 adds `<weight>_scale_inv` beside each


@dataclass(frozen=True)
class ExpertSlot(WeightSlot):
    """One expert's checkpoint tensor (`experts.{e}.gate_proj.weight` or its `weight_scale_inv`): its rows of a
    3-D weight or of that weight's block scales."""

    @torch.no_grad()
    def load(self, value: torch.Tensor) -> None:
        _copy_into(self.tensor(), value)


def _fp8_experts(weight: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """(e4m3 [E, N, K], fp32 block scales [E, ceil(N/128), ceil(K/128)]) parameters for 3-D `weight`, each
    expert quantized on its own as a checkpoint stores it (empty ones on the meta device)."""
    experts = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty(experts, *scale_grid(weight.shape[1:]), dtype=torch.float32, device=weight.device)
    if not weight.is_meta:
        for e in range(experts):
            q[e], scale[e] = quantize_fp8_block(weight[e])
    return nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False)


class Experts(nn.Module):
    """E SwiGLU experts: `gate_up_proj` [E, 2I, H] (rows [0, I) gate, [I, 2I) up) and `down_proj` [E, H, I].

    FP8 storage (`to_fp8`: by the loader for an FP8 checkpoint, by `quant.fp8.quantize_`): a weight becomes e4m3
    and `<weight>_scale_inv` its fp32 block scales [E, ceil(N/128), ceil(K/128)], the per-expert scales stacked
    as the weights are (Hugging Face's `FP8Experts` names). Per-expert FP8 checkpoints stack the gate and up
    scales along rows, so they load in FP8 only when I is a multiple of 128 (Qwen's releases: 512)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        for weight in (self.gate_up_proj, self.down_proj):
            for expert in weight:
                _init_like_nn_linear(expert)
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)
        gate, up = slice(0, intermediate), slice(intermediate, 2 * intermediate)
        # Per-expert checkpoint tensor "e.gate_proj" -> its index into the 3-D weight (WeightSlot reads `rows`).
        self.rows = {}
        for e in range(num_experts):
            self.rows[f"{e}.gate_proj"], self.rows[f"{e}.up_proj"] = (e, gate), (e, up)
            self.rows[f"{e}.down_proj"] = (e, slice(0, hidden))

    def extra_repr(self) -> str:
        fp8 = [w for w in EXPERT_WEIGHTS if self.scale(w) is not None]
        shape = f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}"
        return shape + (f", fp8_block={fp8}" if fp8 else "")

    @staticmethod
    def _weight_name(segment: str) -> str:
        """The 3-D weight of a per-expert segment ("3.up_proj") or of a weight name itself."""
        return "down_proj" if segment.endswith("down_proj") else "gate_up_proj"

    def scale(self, weight: str) -> torch.Tensor | None:
        """The block scales of 3-D weight `weight` ("gate_up_proj"), None when it is in the model dtype."""
        return getattr(self, f"{weight}_scale_inv")

    def segment_tensor(self, name: str, segment: str) -> torch.Tensor:
        """`WeightSlot.tensor` of a per-expert tensor `segment` ("3.up_proj"): a view of its rows of parameter
        `name`, the 3-D weight or its block scales."""
        expert, rows = self.rows[segment]
        if name.endswith("_scale_inv"):
            rows = slice(rows.start // FP8_BLOCK[0], -(-rows.stop // FP8_BLOCK[0]))
        return getattr(self, name)[expert, rows]

    def checkpoint_aliases(self, prefix: str) -> dict[str, WeightSlot]:
        """The per-expert layout of this module's tensors: `<prefix>.{e}.gate_proj.weight` -> its slice, and with
        FP8 storage `<prefix>.{e}.gate_proj.weight_scale_inv` -> its rows of the block scales."""
        aliases = {}
        for segment in self.rows:
            weight = self._weight_name(segment)
            aliases[f"{prefix}.{segment}.weight"] = ExpertSlot(self, weight, segment)
            if self.scale(weight) is not None:
                aliases[f"{prefix}.{segment}.weight_scale_inv"] = ExpertSlot(self, f"{weight}_scale_inv", segment)
        return aliases

    def fp8_candidates(self, path: str) -> list[tuple[str, str]]:
        """(weight, Hugging Face name) of the 3-D weights `to_fp8` can convert (none once converted)."""
        return [(w, f"{path}.{w}") for w in EXPERT_WEIGHTS if self.scale(w) is None]

    def fp8_unsupported(self, segments: Sequence[str]) -> str | None:
        """Why `to_fp8(segments)` cannot keep these tensors in FP8, or None. `segments`: 3-D weight names, or
        per-expert tensors ("3.up_proj", a per-expert checkpoint), whose gate and up scales are stacked along
        rows: I must be a multiple of 128 for the up scales to start on a block."""
        per_expert_gate_up = any(s not in EXPERT_WEIGHTS and self._weight_name(s) == "gate_up_proj" for s in segments)
        if per_expert_gate_up and self.intermediate % FP8_BLOCK[0]:
            return (
                f"the experts' intermediate size {self.intermediate} is not a multiple of {FP8_BLOCK[0]}: the "
                "per-expert gate and up block scales cannot be stacked into one scale grid"
            )
        return None

    @torch.no_grad()
    def to_fp8(self, segments: Sequence[str] | None = None) -> None:
        """Store the 3-D weights that `segments` name (weight names or per-expert tensors; default: both) as e4m3
        with 128x128 block scales, quantizing each expert's current values (none on the meta device)."""
        chosen = EXPERT_WEIGHTS if segments is None else {self._weight_name(s) for s in segments}
        for weight in EXPERT_WEIGHTS:
            if weight in chosen:
                if self.scale(weight) is not None:
                    raise ValueError(f"Experts.to_fp8: {weight} is already in FP8 (a weight is converted once)")
                q, scale = _fp8_experts(getattr(self, weight))
                setattr(self, weight, q)
                setattr(self, f"{weight}_scale_inv", scale)


class SparseMoeBlock(nn.Module):
    """Router + routed experts + shared expert with its sigmoid gate (HF `...SparseMoeBlock`).

    The router `gate` [E, H] and the shared expert's gate [1, H] read the same input, so they are one
    `MergedLinear` (`router`, HF names `gate.weight` and `shared_expert_gate.weight`): one GEMM on CUDA.

    Under tensor parallelism every rank holds the whole router and a slice of every expert's (and the shared
    expert's) intermediate columns, as a dense MLP is split: each rank routes alike and its output is a partial
    sum, linear in the experts' and the shared expert's partial down products, so the block's output is summed
    over the ranks once (`reduce`, set by `qwen_mtp.parallel.apply_tensor_parallel`; the shared expert's own
    down_proj is not reduced)."""

    def __init__(self, hidden: int, config: MoeConfig, intermediate: int | None = None, shared: int | None = None):
        """`intermediate` / `shared`: this rank's columns of each expert / of the shared expert (default: all)."""
        super().__init__()
        self.hidden, self.top_k, self.normalize = hidden, config.top_k, config.norm_topk_prob
        self.router = MergedLinear(hidden, [("gate", config.num_experts), ("shared_expert_gate", 1)])
        self.experts = Experts(config.num_experts, hidden, intermediate or config.intermediate_size)
        self.shared_expert = MLP(hidden, shared or config.shared_intermediate_size)
        self.reduce: Callable[[torch.Tensor, bool], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [..., H] -> [..., H]; `invariant`: each token computed as it would be alone (decode path)."""
        flat = x.reshape(-1, self.hidden)
        logits, shared_gate = self.router(flat, invariant)  # [N, E], [N, 1]
        weights, ids = moe_route(logits, self.top_k, self.normalize)
        shared = self.shared_expert(flat, invariant)
        experts = self.experts
        out = moe(
            flat, experts.gate_up_proj, experts.down_proj, weights, ids, shared, shared_gate, invariant,
            experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv,
        )  # fmt: skip
        if self.reduce is not None:
            out = self.reduce(out, invariant)
        return out.reshape(x.shape)
