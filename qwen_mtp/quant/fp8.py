"""FP8 e4m3 weights with block scales, in the Qwen / DeepSeek checkpoint format, and the verb that stores a
model's projections in it (`quantize_`).

`weight` is float8_e4m3fn [N, K]; `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] is a *multiplier* despite its
name: W[r, c] = fp8[r, c] * scale_inv[r // bn, c // bk]. Edge blocks may be partial. torchao computes the
scales and the e4m3 values (its float8 block primitives, the ones behind `Float8Tensor.from_hp(...,
PerBlock([128, 128]))`, same convention: scale = block amax / 448, a multiplier); it refuses partial blocks, so
edge blocks are zero-padded first (padding changes no block's amax). Dequantizing is transformers' formula,
`(fp8.float() * scale.float()).to(dtype)`, written here because torchao's also refuses partial blocks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

FP8_BLOCK = (128, 128)  # the only weight_block_size the FP8 kernels run (every Qwen FP8 release uses it)
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12  # an all-zero block's amax floor (torchao's float8 eps): its scale stays finite, its values 0


def scale_grid(shape: Sequence[int], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    """The block-scale shape [ceil(N/bn), ceil(K/bk)] of an [N, K] weight."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = block
    return scale.repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., : shape[-2], : shape[-1]]


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """fp8 [..., N, K] and its block scales [..., ceil(N/bn), ceil(K/bk)] (3-D MoE experts: one grid per expert)
    -> fp32 [..., N, K] (cast to the model dtype after: transformers' rounding)."""
    return weight.float() * _expand(scale_inv.float(), weight.shape, block)


def _torchao_primitives():
    # Nothing we use lives in torchao's compiled extensions (CUDA sparse / SM100 kernels, built for one torch):
    # skip loading them, which on a CPU-only torch or another torch version only prints warnings.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8
    except ImportError as err:
        raise ImportError(f"quantizing to FP8 blocks needs torchao (`pip install torchao`): {err}") from None
    return _choose_scale_float8, _quantize_affine_float8


@torch.no_grad()
def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scale [ceil(N/bn), ceil(K/bk)]): each block's amax maps to 448. As in
    torchao, amax / 448 is computed in the weight's dtype (a bf16 weight gets bf16-representable scales, like
    Qwen's releases), the division in fp32."""
    choose_scale, quantize = _torchao_primitives()
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -k % block[1], 0, -n % block[0]))  # amax in weight's dtype
    scale = choose_scale(padded, list(block), torch.float8_e4m3fn, hp_value_lb=SCALE_FLOOR)
    return quantize(padded, scale, torch.float8_e4m3fn)[:n, :k].contiguous(), scale


@dataclass(frozen=True)
class Fp8BlockConfig:
    """Which projections `quantize_` stores in FP8: every one but those whose Hugging Face name contains an entry
    of `modules_to_not_convert` as whole dotted components ("mlp.gate" skips `layers.0.mlp.gate`, the MoE
    router, not `mlp.gate_proj`). Default: what Qwen's FP8 releases keep in bf16 (the MoE routers too: small
    matrices, faster in bf16); embeddings and norms are not projections and always stay."""

    modules_to_not_convert: tuple[str, ...] = (
        "lm_head", "mtp.fc", "in_proj_a", "in_proj_b", "mlp.gate", "shared_expert_gate",
    )  # fmt: skip


def quantize_(model: nn.Module, config: Fp8BlockConfig | None = None) -> nn.Module:
    """Store `model`'s projections in FP8 128x128 blocks, in place (torchao's verb, on our linear modules):
    each `Linear` / `MergedLinear` segment / MoE `Experts` weight the config selects is quantized from its
    current values (on the meta device: only the storage changes, for a checkpoint to fill). Segments already in
    FP8 are left as they are, and so are merged projections whose segments cannot share one FP8 weight (with a
    warning). Returns the model."""
    skip = (config or Fp8BlockConfig()).modules_to_not_convert
    for path, module in list(model.named_modules()):
        if not hasattr(module, "fp8_candidates") or path == "lm_head":  # model.logits reads it as a plain weight
            continue
        chosen = [
            seg for seg, name in module.fp8_candidates(path) if not any(f".{e}." in f".{name}." for e in skip)
        ]  # fmt: skip
        if not chosen:
            continue
        problem = module.fp8_unsupported(chosen)
        if problem:
            warnings.warn(f"quantize_: {path} stays in {module.weight.dtype}: {problem}", stacklevel=2)
        else:
            module.to_fp8(chosen)
    return model
