"""The sparse MoE MLP of Qwen3.5-MoE and Qwen3-Next: a softmax top-k router, the routed SwiGLU experts and a
shared expert scaled by a sigmoid gate:

    weights, ids = top-k of softmax(gate(x)) (renormalised)          # qwen_mtp::moe_route
    out = sum_j weights_j * expert_{ids_j}(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)   # qwen_mtp::moe

The experts are stored as Hugging Face's model holds them, two 3-D weights per layer (`experts.gate_up_proj`
[E, 2I, H], gate rows then up rows; `experts.down_proj` [E, H, I]); checkpoints that store one tensor per
expert (`experts.{e}.gate_proj.weight`, ...) load into their slices (`Experts.checkpoint_aliases`).
"""

from __future__ import annotations

import torch
from torch import nn

from qwen_mtp.config import MoeConfig
from qwen_mtp.model.layers import MLP
from qwen_mtp.model.linear import MergedLinear, _init_like_nn_linear
from qwen_mtp.model.weights import WeightSlot
from qwen_mtp.ops.moe import moe, moe_route

PER_EXPERT = ("gate_proj", "up_proj", "down_proj")  # the per-expert checkpoint tensors, in HF's names


class Experts(nn.Module):
    """E SwiGLU experts: `gate_up_proj` [E, 2I, H] (rows [0, I) gate, [I, 2I) up) and `down_proj` [E, H, I].

    An FP8 block checkpoint adds a scale per weight, [E, ceil(N/128), ceil(K/128)] beside each [E, N, K] e4m3
    weight (the per-expert scales stacked as the weights are)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        for weight in (self.gate_up_proj, self.down_proj):
            for expert in weight:
                _init_like_nn_linear(expert)
        gate, up = slice(0, intermediate), slice(intermediate, 2 * intermediate)
        # Per-expert checkpoint tensor "e.gate_proj" -> its index into the 3-D weight (WeightSlot reads `rows`).
        self.rows = {}
        for e in range(num_experts):
            self.rows[f"{e}.gate_proj"], self.rows[f"{e}.up_proj"] = (e, gate), (e, up)
            self.rows[f"{e}.down_proj"] = (e, slice(None))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}"

    @staticmethod
    def _weight_name(segment: str) -> str:
        return "down_proj" if segment.endswith("down_proj") else "gate_up_proj"

    def _weight_of(self, segment: str) -> torch.Tensor:
        return getattr(self, self._weight_name(segment))

    def segment_weight(self, segment: str) -> torch.Tensor:
        """Per-expert tensor `segment` ("3.up_proj"): a view of its rows of the 3-D weight."""
        return self._weight_of(segment)[self.rows[segment]]

    def segment_tensor(self, name: str, segment: str) -> torch.Tensor:
        """`WeightSlot.tensor` of a per-expert tensor (the experts hold no block scales: FP8 ones are dequantized)."""
        return self.segment_weight(segment)

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor, segment: str) -> None:
        """Copy one expert's checkpoint tensor into its slice (cast to the weight's dtype)."""
        self.segment_weight(segment).copy_(tensor)

    def checkpoint_aliases(self, prefix: str) -> dict[str, WeightSlot]:
        """The per-expert layout of this module's tensors: `<prefix>.{e}.gate_proj.weight` -> its slice."""
        return {
            f"{prefix}.{segment}.weight": WeightSlot(self, self._weight_name(segment), segment) for segment in self.rows
        }


class SparseMoeBlock(nn.Module):
    """Router + routed experts + shared expert with its sigmoid gate (HF `...SparseMoeBlock`).

    The router `gate` [E, H] and the shared expert's gate [1, H] read the same input, so they are one
    `MergedLinear` (`router`, HF names `gate.weight` and `shared_expert_gate.weight`): one GEMM on CUDA."""

    def __init__(self, hidden: int, config: MoeConfig):
        super().__init__()
        self.hidden, self.top_k, self.normalize = hidden, config.top_k, config.norm_topk_prob
        self.router = MergedLinear(hidden, [("gate", config.num_experts), ("shared_expert_gate", 1)])
        self.experts = Experts(config.num_experts, hidden, config.intermediate_size)
        self.shared_expert = MLP(hidden, config.shared_intermediate_size)

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [..., H] -> [..., H]; `invariant`: each token computed as it would be alone (decode path)."""
        flat = x.reshape(-1, self.hidden)
        logits, shared_gate = self.router(flat, invariant)  # [N, E], [N, 1]
        weights, ids = moe_route(logits, self.top_k, self.normalize)
        shared = self.shared_expert(flat, invariant)
        out = moe(flat, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, shared, shared_gate, invariant)
        return out.reshape(x.shape)
