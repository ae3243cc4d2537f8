"""Linear layers that own their weight: `Linear` (one projection) and `MergedLinear` (projections that read the
same input, stored as one fused weight). Both compute through the one linear op, `qwen_mtp::linear`.

The module, not the caller, knows how its weight is stored, so loading a checkpoint tensor is its method
(`weight_loader`): the FP8 block scale and the tensor-parallel shard that later land here change these
modules and nothing above them. Batch invariance is an argument of each call (the decode path asks for it),
not a mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from qwen_mtp.ops.linear import linear


def _init_like_nn_linear(weight: torch.Tensor) -> None:
    """nn.Linear's default initialisation (checkpoint loads overwrite it; a model built from scratch is usable)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class Linear(nn.Module):
    """y = x W^T with W [out_features, in_features] (no bias: no Qwen3.5 projection has one).

    Under tensor parallelism a row-parallel linear holds a block of W's columns and its product is a partial
    sum: `reduce(partial, invariant)` (set by `qwen_mtp.parallel.apply_tensor_parallel`) sums it over the ranks.
    At tp = 1 it is None and the forward has no collective."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        _init_like_nn_linear(self.weight)
        self.reduce: Callable[[torch.Tensor, bool], torch.Tensor] | None = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out]; `invariant`: each row computed as it would be alone (decode path)."""
        out = linear(x, self.weight, invariant)
        return out if self.reduce is None else self.reduce(out, invariant)

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor [out, in] into the weight (cast to its dtype and device)."""
        self.weight.copy_(tensor)


class MergedLinear(nn.Module):
    """Several projections of the same input as one weight [sum N, K]: segment i (named by its Hugging Face
    attribute, e.g. `in_proj_qkv`) is the block of rows N_0 + ... + N_{i-1} onwards.

    On CUDA one GEMM computes every segment and the segments are strided slices of its output (one launch
    instead of several per layer on the decode path). Elsewhere each segment is its own product over its rows
    of the fused weight, which is what Hugging Face computes with separate projections: CPU results stay
    bit-exact with it. `one_gemm` (set with `QwenHybridForCausalLM.use_one_gemm`) forces either path, so
    the CUDA layout can be tested on CPU.
    """

    def __init__(self, in_features: int, segments: Sequence[tuple[str, int]]):
        super().__init__()
        self.in_features = in_features
        self.segments = dict(segments)  # HF attribute name -> out features, in weight-row order
        if len(self.segments) != len(segments):
            raise ValueError(f"segment names must be distinct, got {[name for name, _ in segments]}")
        self.sizes = list(self.segments.values())
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.rows = {name: slice(start, start + size) for (name, size), start in zip(segments, starts, strict=True)}
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
        _init_like_nn_linear(self.weight)
        self.one_gemm: bool | None = None  # None: one GEMM on CUDA, a product per segment elsewhere

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, segments={self.segments}"

    def segment_weight(self, segment: str) -> torch.Tensor:
        """Segment `segment`'s weight [N_i, K]: a view of its rows of the fused weight."""
        return self.weight[self.rows[segment]]

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor, segment: str) -> None:
        """Copy the checkpoint tensor of projection `segment` [N_i, K] into its rows (cast to the weight's dtype)."""
        self.segment_weight(segment).copy_(tensor)

    def _uses_one_gemm(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.one_gemm is None else self.one_gemm

    def forward(self, x: torch.Tensor, invariant: bool = False) -> tuple[torch.Tensor, ...]:
        """x [..., K] -> one output [..., N_i] per segment, in order (strided slices of one GEMM's output on
        the one-GEMM path)."""
        if self._uses_one_gemm(x):
            return torch.split(linear(x, self.weight, invariant), self.sizes, dim=-1)
        return tuple(linear(x, self.segment_weight(name), invariant) for name in self.segments)

    def fused(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """All segments side by side, [..., sum N] (for an op that reads them together, like SwiGLU)."""
        if self._uses_one_gemm(x):
            return linear(x, self.weight, invariant)
        return torch.cat(self.forward(x, invariant), dim=-1)
