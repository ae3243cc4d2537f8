"""Linear layers that own their weight: `Linear` (one projection) and `MergedLinear` (projections that read the
same input, stored as one fused weight). Both compute through the one linear op, `qwen_mtp::linear`, or, with
FP8 block weights, its sibling `qwen_mtp::linear_fp8`.

The module, not the caller, knows how its weight is stored, so loading a checkpoint tensor is its method
(`weight_loader`): the FP8 block scale and the tensor-parallel shard that later land here change these
modules and nothing above them. Batch invariance is an argument of each call (the decode path asks for it),
not a mode.

FP8 storage (`to_fp8`, done by the loader for an FP8 checkpoint and by `quant.fp8.quantize_`): `weight` becomes
float8_e4m3fn [N, K] and `weight_scale_inv` its fp32 block scales [ceil(N/128), ceil(K/128)] (a multiplier, the
checkpoint's name and meaning), and `fp8_decode` says how the CUDA decode path multiplies it: "w8a8" (activations
quantized to e4m3 per 1x128 group, the default) or "w8a16" (bf16 activations: transformers' numbers); set by
`quant.fp8.set_fp8_decode` from the recipe's `model.fp8_decode`. A merged projection concatenates its FP8 segments'
weights and scales along N, so every FP8 segment but the last must have a multiple of 128 rows (a scale block must
not straddle two segments); segments kept in the model dtype (the GDN's in_proj_b/a in Qwen's releases) move to
`unquantized_weight`, a second fused weight with its own GEMM. Cast a model (`.to(dtype)`) before `to_fp8`:
Module.to casts every floating tensor, e4m3 included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from qwen_mtp.ops.linear import linear, linear_fp8, w8a8_input_wanted
from qwen_mtp.quant.fp8 import FP8_BLOCK, check_kernel_scales, quantize_fp8_block, scale_grid


def _init_like_nn_linear(weight: torch.Tensor) -> None:
    """nn.Linear's default initialisation (checkpoint loads overwrite it; a model built from scratch is usable)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _fp8_storage(weight: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """(e4m3 weight, fp32 block scale) parameters for `weight`'s values (empty ones on the meta device)."""
    if weight.is_meta:
        q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device="meta")
        scale = torch.empty(scale_grid(weight.shape), dtype=torch.float32, device="meta")
    else:
        q, scale = quantize_fp8_block(weight)
    return nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False)


def _copy_into(stored: torch.Tensor, tensor: torch.Tensor) -> None:
    if stored.dtype == torch.float8_e4m3fn and tensor.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"cannot copy a {tensor.dtype} tensor into an FP8 weight (it needs its block scale): store the model "
            "in its dtype and quantize it with qwen_mtp.quant.fp8.quantize_"
        )
    stored.copy_(tensor)


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
        self.register_parameter("weight_scale_inv", None)  # FP8 storage: the weight's block scales
        self.fp8_decode = "w8a8"  # FP8 storage: the CUDA decode product, "w8a8" or "w8a16" (module docstring)
        self.reduce: Callable[[torch.Tensor, bool], torch.Tensor] | None = None

    def extra_repr(self) -> str:
        fp8 = ", fp8_block=128x128" if self.weight_scale_inv is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{fp8}"

    def forward(
        self, x: torch.Tensor, invariant: bool = False, x_w8a8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x [..., in] -> [..., out]; `invariant`: each row computed as it would be alone (decode path); `x_w8a8`:
        x's rows already quantized for W8A8 (e4m3, scales) by the op that made x (`takes_w8a8_input`)."""
        if self.weight_scale_inv is not None:
            w8a8 = self.fp8_decode == "w8a8"
            out = linear_fp8(x, self.weight, self.weight_scale_inv, invariant, w8a8, *(x_w8a8 or (None, None)))
        else:
            out = linear(x, self.weight, invariant)
        return out if self.reduce is None else self.reduce(out, invariant)

    def takes_w8a8_input(self, x: torch.Tensor) -> bool:
        """Whether the decode-path product quantizes x for W8A8 (`ops.linear.w8a8_input_wanted`): then the op that
        makes x may quantize it in its own launch and pass it as `x_w8a8` (one launch fewer, the same bits)."""
        return w8a8_input_wanted(x, self.weight, self.weight_scale_inv, self.fp8_decode == "w8a8")

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor [out, in] into the weight (cast to its dtype and device)."""
        _copy_into(self.weight, tensor)

    def fp8_candidates(self, path: str) -> list[tuple[None, str]]:
        """(segment, Hugging Face module name) of what `to_fp8` can convert: the one weight, at `path`."""
        return [] if self.weight_scale_inv is not None else [(None, path)]

    def fp8_unsupported(self, segments: list[None]) -> str | None:
        """Why `to_fp8` cannot store this weight in FP8 blocks (never: edge blocks may be partial)."""
        return None

    @torch.no_grad()
    def to_fp8(self, segments: list[None] | None = None) -> None:
        """Store the weight as e4m3 with 128x128 block scales, quantizing its current values."""
        if self.weight_scale_inv is not None:
            raise ValueError("Linear.to_fp8: already in FP8 (a module is converted once)")
        self.weight, self.weight_scale_inv = _fp8_storage(self.weight)

    @torch.no_grad()
    def scale_loader(self, tensor: torch.Tensor, segment: None = None) -> None:
        """Copy a checkpoint `weight_scale_inv` [ceil(out/128), ceil(in/128)] into the block scales."""
        check_kernel_scales(tensor)
        self.weight_scale_inv.copy_(tensor)


class MergedLinear(nn.Module):
    """Several projections of the same input as one weight [sum N, K]: segment i (named by its Hugging Face
    attribute, e.g. `in_proj_qkv`) is the block of rows N_0 + ... + N_{i-1} onwards.

    On CUDA one GEMM computes every segment and the segments are strided slices of its output (one launch
    instead of several per layer on the decode path). Elsewhere each segment is its own product over its rows
    of the fused weight, which is what Hugging Face computes with separate projections: CPU results stay
    bit-exact with it. `one_gemm` (set with `QwenHybridForCausalLM.use_one_gemm`) forces either path, so
    the CUDA layout can be tested on CPU. With FP8 storage of only some segments, the others live in
    `unquantized_weight` (same layout, in segment order) and the one-GEMM path runs one GEMM per stored weight.
    """

    def __init__(self, in_features: int, segments: Sequence[tuple[str, int]]):
        super().__init__()
        self.in_features = in_features
        self.segments = dict(segments)  # HF attribute name -> out features, in weight-row order
        if len(self.segments) != len(segments):
            raise ValueError(f"segment names must be distinct, got {[name for name, _ in segments]}")
        self.sizes = list(self.segments.values())
        self.home = dict.fromkeys(self.segments, "weight")  # segment -> the parameter holding its rows
        self.rows = self._row_slices()  # segment -> its rows of that parameter
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
        _init_like_nn_linear(self.weight)
        self.register_parameter("weight_scale_inv", None)  # FP8 storage: block scales of `weight`
        self.register_parameter("unquantized_weight", None)  # FP8 storage: the segments kept in the model dtype
        self.fp8_decode = "w8a8"  # FP8 storage: the CUDA decode product, "w8a8" or "w8a16" (module docstring)
        self.one_gemm: bool | None = None  # None: one GEMM on CUDA, a product per segment elsewhere

    def _row_slices(self) -> dict[str, slice]:
        rows, start = {}, dict.fromkeys(self.home.values(), 0)
        for name, size in self.segments.items():
            home = self.home[name]
            rows[name], start[home] = slice(start[home], start[home] + size), start[home] + size
        return rows

    def extra_repr(self) -> str:
        fp8 = [name for name in self.segments if self.is_fp8(name)]
        return f"in_features={self.in_features}, segments={self.segments}" + (f", fp8_block={fp8}" if fp8 else "")

    def is_fp8(self, segment: str) -> bool:
        return self.home[segment] == "weight" and self.weight_scale_inv is not None

    def stored_segments(self, name: str) -> list[str]:
        """The segments whose rows parameter `name` holds, in row order (a scale: those of `weight`)."""
        home = "weight" if name == "weight_scale_inv" else name
        return [segment for segment in self.segments if self.home[segment] == home]

    def segment_weight(self, segment: str) -> torch.Tensor:
        """Segment `segment`'s weight [N_i, K]: a view of its rows of the fused weight."""
        return getattr(self, self.home[segment])[self.rows[segment]]

    def segment_scale(self, segment: str) -> torch.Tensor:
        """An FP8 segment's block scales [ceil(N_i/128), ceil(K/128)]: a view of its rows of `weight_scale_inv`."""
        rows = self.rows[segment]
        return self.weight_scale_inv[rows.start // FP8_BLOCK[0] : -(-rows.stop // FP8_BLOCK[0])]

    def segment_tensor(self, name: str, segment: str) -> torch.Tensor:
        """Segment `segment`'s part of parameter `name` (a weight or the block scales)."""
        return self.segment_scale(segment) if name == "weight_scale_inv" else self.segment_weight(segment)

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor, segment: str) -> None:
        """Copy the checkpoint tensor of projection `segment` [N_i, K] into its rows (cast to the weight's dtype)."""
        _copy_into(self.segment_weight(segment), tensor)

    @torch.no_grad()
    def scale_loader(self, tensor: torch.Tensor, segment: str) -> None:
        """Copy projection `segment`'s checkpoint `weight_scale_inv` into its rows of the block scales."""
        check_kernel_scales(tensor)
        self.segment_scale(segment).copy_(tensor)

    def fp8_candidates(self, path: str) -> list[tuple[str, str]]:
        """(segment, Hugging Face module name) of the segments `to_fp8` can convert (none once converted)."""
        if self.weight_scale_inv is not None:
            return []
        parent = path.rpartition(".")[0]
        return [(seg, f"{parent}.{seg}" if parent else seg) for seg in self.segments]

    def fp8_unsupported(self, segments: Sequence[str]) -> str | None:
        """Why `to_fp8(segments)` cannot hold these segments in one FP8 weight, or None: their scales are
        concatenated along N, so each but the last must have a multiple of 128 rows."""
        chosen = [name for name in self.segments if name in segments]
        uneven = [name for name in chosen[:-1] if self.segments[name] % FP8_BLOCK[0]]
        if uneven:
            return (
                f"segments {uneven} have {[self.segments[n] for n in uneven]} rows, not multiples of "
                f"{FP8_BLOCK[0]}: their block scales cannot be concatenated with the next segment's"
            )
        return None

    @torch.no_grad()
    def to_fp8(self, segments: Sequence[str] | None = None) -> None:
        """Store `segments` (default: all) as e4m3 with 128x128 block scales in `weight`, quantizing their current
        values (none on the meta device), and any others in `unquantized_weight`, keeping their values."""
        if self.weight_scale_inv is not None:
            raise ValueError("MergedLinear.to_fp8: already in FP8 (a module is converted once)")
        chosen = [name for name in self.segments if segments is None or name in segments]
        problem = self.fp8_unsupported(chosen)
        if problem:
            raise ValueError(f"MergedLinear.to_fp8: {problem}")
        values = {name: self.segment_weight(name) for name in self.segments}
        kept = [name for name in self.segments if name not in chosen]
        self.weight, self.weight_scale_inv = _fp8_storage(torch.cat([values[name] for name in chosen]))
        if kept:
            rest = torch.cat([values[name] for name in kept])
            self.unquantized_weight = nn.Parameter(rest, requires_grad=values[kept[0]].requires_grad)
        self.home = {name: "weight" if name in chosen else "unquantized_weight" for name in self.segments}
        self.rows = self._row_slices()

    def _uses_one_gemm(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.one_gemm is None else self.one_gemm

    def _product(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, invariant: bool, x_w8a8=None):
        if scale is None:
            return linear(x, weight, invariant)
        return linear_fp8(x, weight, scale, invariant, self.fp8_decode == "w8a8", *(x_w8a8 or (None, None)))

    def _segment_product(self, x: torch.Tensor, segment: str, invariant: bool) -> torch.Tensor:
        scale = self.segment_scale(segment) if self.is_fp8(segment) else None
        return self._product(x, self.segment_weight(segment), scale, invariant)

    def takes_w8a8_input(self, x: torch.Tensor) -> bool:
        """Whether the one-GEMM decode-path product of the FP8 segments quantizes x for W8A8 (`Linear`'s)."""
        wanted = w8a8_input_wanted(x, self.weight, self.weight_scale_inv, self.fp8_decode == "w8a8")
        return self._uses_one_gemm(x) and wanted

    def forward(
        self, x: torch.Tensor, invariant: bool = False, x_w8a8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """x [..., K] -> one output [..., N_i] per segment, in order (strided slices of one GEMM's output per
        stored weight on the one-GEMM path). `x_w8a8`: as for `Linear` (the FP8 segments' product takes it)."""
        if not self._uses_one_gemm(x):
            return tuple(self._segment_product(x, name, invariant) for name in self.segments)
        outputs = {}
        for home, scale in (("weight", self.weight_scale_inv), ("unquantized_weight", None)):
            names = self.stored_segments(home)
            if names:
                out = self._product(x, getattr(self, home), scale, invariant, x_w8a8)
                outputs.update(zip(names, torch.split(out, [self.segments[n] for n in names], dim=-1), strict=True))
        return tuple(outputs[name] for name in self.segments)

    def fused(
        self, x: torch.Tensor, invariant: bool = False, x_w8a8: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """All segments side by side, [..., sum N] (for an op that reads them together, like SwiGLU)."""
        if self._uses_one_gemm(x) and self.unquantized_weight is None:
            return self._product(x, self.weight, self.weight_scale_inv, invariant, x_w8a8)
        return torch.cat(self.forward(x, invariant, x_w8a8), dim=-1)
