"""Hugging Face checkpoint directory -> `QwenHybridForCausalLM`, keeping the `mtp.*` weights other loaders drop.

Accepts one `model.safetensors`, shards listed in `model.safetensors.index.json`, or a folder of shards; the
prefixes `model.language_model.` (VLM layout) and `model.` (text layout); ignores the vision tower. Each tensor
is written where the model's name table (`QwenHybridForCausalLM.checkpoint_slots`) says: a parameter, or a
segment of a merged projection. MoE experts load from either layout: one tensor per expert
(`experts.{e}.gate_proj.weight`, ...) or the 3-D `experts.gate_up_proj` / `experts.down_proj`. Every error names
the tensor or file.

FP8 block checkpoints (`weight` e4m3 + `weight_scale_inv`, `quantization_config.weight_block_size` [128, 128]):
every projection the checkpoint stores in FP8 stays FP8 (weights and scales as stored; the scales in fp32, an
exact upcast of bf16 ones), and whatever it keeps in bf16 (`modules_to_not_convert`: lm_head, embeddings, norms,
conv1d, A_log, dt_bias, in_proj_a/b, mtp.fc) loads as usual. An FP8 tensor the model cannot hold in FP8 (the
lm_head, which `model.logits` reads as a plain weight; an embedding or norm; the segments of a merged projection
whose rows are not multiples of 128, and per-expert MoE gate/up tensors whose intermediate size is not, with a
warning; Qwen3-Next's interleaved `in_proj_qkvz`, whose rows scatter over the fused weight) is dequantized at
load exactly as transformers does
(`(fp8.float() * scale.float()).to(dtype)`), which gives the numbers the FP8 reference path computes.
`quant="dequantize"` dequantizes every FP8 tensor (any block size); `quant="fp8-block"` also quantizes the bf16
projections Qwen's FP8 releases quantize (`quant.fp8.quantize_`), so a BF16 checkpoint loads in FP8.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from qwen_mtp.config import ModelConfig
from qwen_mtp.dtypes import DTYPES
from qwen_mtp.errors import CheckpointError
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.model.moe import Experts
from qwen_mtp.model.next_layout import PermutedSlot
from qwen_mtp.parallel.group import TensorParallel
from qwen_mtp.parallel.plan import ShardPlan, TensorShard
from qwen_mtp.quant.fp8 import FP8_BLOCK, dequantize_fp8_block, quantize_, scale_grid

FLOAT_DTYPES = tuple(DTYPES.values())  # the checkpoint dtypes loaded as they are (fp8 is dequantized)
IGNORED_PREFIXES = ("model.visual.", "visual.")
SCALE_SUFFIX = "_scale_inv"
QUANT_MODES = ("none", "fp8-block", "dequantize")


def checkpoint_name(name: str) -> str | None:
    """The text-layout Hugging Face name of a checkpoint tensor (the model's name table uses those), or None
    for tensors we ignore (vision)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def checkpoint_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"cannot read {index}: {err!r}") from None
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read safetensors file {file}: {err}") from None


def _tensor_names(files: list[Path]) -> dict[str, Path]:
    names: dict[str, Path] = {}
    for file in files:
        with _open(file) as handle:
            for name in handle.keys():
                names[name] = file
    return names


def _iter_tensors(
    files: list[Path], progress: bool, shard_of: Callable[[str], TensorShard | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name on disk, tensor) for every tensor, or only the rows/columns `shard_of(name)` says this
    tensor-parallel rank holds (read through `get_slice`: the rest of the tensor is never read)."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), desc="loading shards", unit="file")
    for file in files:
        with _open(file) as handle:
            for name in handle.keys():
                shard = shard_of(name)
                try:
                    yield name, handle.get_tensor(name) if shard is None else shard.read(handle.get_slice(name))
                except (SafetensorError, OSError, ValueError) as err:
                    raise CheckpointError(f"cannot read tensor {name} from {file}: {err}") from None
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def _missing(absent: set[str], aliases: dict[str, tuple[str, object]]) -> set[str]:
    """The absent tensors that matter: a 3-D expert weight is there when all its per-expert parts are, and its
    parts are not needed when it is (a checkpoint holds one layout or the other)."""
    parts: dict[str, list[str]] = {}
    for alias, (whole, _) in aliases.items():
        parts.setdefault(whole, []).append(alias)
    missing = absent - set(aliases) - set(parts)
    for whole, names in parts.items():
        if whole in absent and any(n not in absent for n in names):
            missing |= {n for n in names if n in absent}  # a per-expert checkpoint lacking some experts' tensors
        elif whole in absent:
            missing.add(whole)
    return missing


def _rank_slices(config: ModelConfig, parallel: TensorParallel | None) -> Callable[[str], TensorShard | None]:
    """Disk name -> the slice of it this rank reads (None: all of it). An FP8 block scale takes the blocks of
    its weight's slice, so a slice must start and end on a block boundary (128 for Qwen's FP8 releases)."""
    if parallel is None or parallel.degree == 1:
        return lambda name: None
    plan = ShardPlan(config, parallel.degree, parallel.rank)

    def shard_of(disk_name: str) -> TensorShard | None:
        name = checkpoint_name(disk_name)
        if name is None or not name.endswith(SCALE_SUFFIX):
            return None if name is None else plan.shard(name)
        weight = plan.shard(name[: -len(SCALE_SUFFIX)])
        if weight is None or config.weight_block_size is None:
            return weight
        block = config.weight_block_size[weight.matrix_axis]
        blocks = weight.blocks(block)
        if blocks is None:
            raise CheckpointError(
                f"fp8 tensor {name[: -len(SCALE_SUFFIX)]}: parallel.tp={parallel.degree} splits its "
                f"{('rows', 'columns')[weight.matrix_axis]} into {list(weight.ranges)}, not on its "
                f"{block}-wide scale blocks; use a degree whose shards are whole blocks (or the bf16 checkpoint)"
            )
        return blocks

    return shard_of


def resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or config.torch_dtype or "bfloat16"
    if name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_device(device: torch.device | str) -> torch.device:
    """The device to load onto; a CheckpointError, before anything is read, for one that cannot be used."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise CheckpointError(f"invalid device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(f"device {str(resolved)!r} requested but no CUDA device is available; use 'cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise CheckpointError(f"device {str(resolved)!r} requested but only {count} CUDA device(s) are visible")
    elif resolved.type != "cpu":
        raise CheckpointError(f"unsupported device {str(resolved)!r}: use 'cpu', 'cuda' or 'cuda:N'")
    return resolved


def _keep_fp8(model: QwenHybridForCausalLM, fp8_names: set[str], block: tuple[int, int] | None) -> None:
    """Switch the projections the checkpoint stores in FP8 to FP8 storage (on the meta device, before loading)."""
    chosen: dict[nn.Module, tuple[str, list]] = {}
    slots = model.checkpoint_slots() | {name: slot for name, (_, slot) in model.checkpoint_aliases().items()}
    for name, slot in slots.items():
        if isinstance(slot, PermutedSlot):  # Qwen3-Next's in_proj_qkvz: its scale blocks match no fused rows
            continue
        if name in fp8_names and hasattr(slot.module, "to_fp8") and slot.module is not model.lm_head:
            # MoE experts: a per-expert tensor ("3.up_proj") or the 3-D weight itself (a fused-layout checkpoint)
            part = slot.name if isinstance(slot.module, Experts) and slot.segment is None else slot.segment
            chosen.setdefault(slot.module, (name, []))[1].append(part)
    if chosen and tuple(block or ()) != FP8_BLOCK:
        name = next(iter(chosen.values()))[0]
        raise CheckpointError(
            f"fp8 tensor {name}: quantization_config.weight_block_size {list(block) if block else None} is not "
            f"supported (the FP8 kernels run {list(FP8_BLOCK)} blocks); load it with quant='dequantize'"
        )
    for module, (name, segments) in chosen.items():
        problem = module.fp8_unsupported(segments)
        if problem:
            warnings.warn(f"fp8 tensor {name}: {problem}; this projection is dequantized at load", stacklevel=3)
        else:
            module.to_fp8(segments)


def _check_fp8_tensor(name: str, tensor: torch.Tensor, scale: torch.Tensor | None, block) -> None:
    if scale is None:
        raise CheckpointError(f"fp8 tensor {name} has no {name}{SCALE_SUFFIX}")
    if block is None:
        raise CheckpointError(f"fp8 tensor {name} but config.json has no quantization_config")
    grid = (*tensor.shape[:-2], *scale_grid(tensor.shape[-2:], block))  # 3-D experts: a grid per expert
    if tuple(scale.shape) != grid:
        raise CheckpointError(
            f"block scale {name}{SCALE_SUFFIX} has shape {list(scale.shape)}; {list(block)} blocks of an "
            f"{list(tensor.shape)} weight need {list(grid)}"
        )
    if scale.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"block scale {name}{SCALE_SUFFIX} has dtype {scale.dtype}; expected a float dtype")


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    quant: str = "none",
    parallel: TensorParallel | None = None,
) -> QwenHybridForCausalLM:
    """Load a Qwen3.5 (dense or MoE) or Qwen3-Next checkpoint with its MTP head.

    `dtype` defaults to the checkpoint's `dtype` (else bfloat16); every parameter is cast to it, as Hugging Face
    does (FP8 projections stay FP8). A checkpoint with no `mtp.*` tensors at all loads without a head
    (`model.mtp is None`); one with an incomplete head is an error. `quant`: "none" (as stored), "fp8-block"
    (FP8 projections, quantizing bf16 ones) or "dequantize" (every FP8 tensor to `dtype`). With `parallel` (a
    tensor-parallel rank) the model is that rank's shard and only its slices are read (FP8 scales by block);
    with the rank's process group its collectives are applied too.
    """
    if quant not in QUANT_MODES:
        raise CheckpointError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    device = check_device(device)
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    files = checkpoint_files(path)
    on_disk = _tensor_names(files)
    names = {checkpoint_name(n) for n in on_disk} - {None}
    if "lm_head.weight" not in names and not config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=True)  # no lm_head on disk: it is the embedding
    if not any(n.startswith("mtp.") for n in names):
        config = dataclasses.replace(config, mtp_num_hidden_layers=0)
    dtype = resolve_dtype(dtype, config)
    tp = 1 if parallel is None else parallel.degree
    with torch.device("meta"):
        # Every parameter in `dtype`, as Hugging Face casts them; a ConfigError names what tp does not divide.
        model = QwenHybridForCausalLM(config, tp).to(dtype)
    if quant != "dequantize":
        scaled = {n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}
        _keep_fp8(model, scaled, config.weight_block_size)
    expected = {name: slot.shape for name, slot in model.checkpoint_slots().items()}
    aliases = model.checkpoint_aliases()  # per-expert MoE tensors: parts of the 3-D expert weights
    expected.update({name: slot.shape for name, (_, slot) in aliases.items()})

    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for raw_name, tensor in _iter_tensors(files, progress, _rank_slices(config, parallel)):
        name = checkpoint_name(raw_name)
        if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if name in expected:
            weights[name] = tensor
        elif name.endswith(SCALE_SUFFIX):
            scales[name[: -len(SCALE_SUFFIX)]] = tensor
        else:
            unexpected.append(raw_name)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in checkpoint {path}: {sorted(unexpected)[:20]}")
    missing = sorted(_missing(set(expected) - set(weights), aliases))
    if missing:
        raise CheckpointError(f"missing tensors in checkpoint {path}: {missing[:20]}")

    slots = model.checkpoint_slots() | {name: slot for name, (_, slot) in aliases.items()}
    block = config.weight_block_size
    for name, tensor in weights.items():
        stored = slots[name].tensor().dtype
        if name.endswith(SCALE_SUFFIX):
            _check_fp8_tensor(name[: -len(SCALE_SUFFIX)], weights[name[: -len(SCALE_SUFFIX)]], tensor, block)
        elif stored == torch.float8_e4m3fn:
            if tensor.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"tensor {name} has dtype {tensor.dtype} but a block scale {name}{SCALE_SUFFIX}")
        elif tensor.dtype == torch.float8_e4m3fn:
            _check_fp8_tensor(name, tensor, scales.get(name), block)
            tensor = dequantize_fp8_block(tensor, scales.pop(name), block)
        elif tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}; expected a float dtype or fp8 e4m3")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {name} has shape {list(tensor.shape)} but the config implies {list(expected[name])}"
            )
        weights[name] = tensor
    if scales:
        raise CheckpointError(f"block scales without an fp8 weight: {sorted(scales)[:20]}")
    model = model.to_empty(device=device)
    slots = model.checkpoint_slots() | {name: slot for name, (_, slot) in model.checkpoint_aliases().items()}
    for name in list(weights):
        slot = slots[name]
        slot.load(weights.pop(name).to(device=device, dtype=slot.tensor().dtype))  # each host copy freed once written
    model.init_non_persistent_buffers(device)
    if quant == "fp8-block":
        quantize_(model)  # a rank quantizes its own shard (its blocks are the whole model's when 128-aligned)
    if parallel is not None and parallel.group is not None and parallel.degree > 1:
        from qwen_mtp.parallel.apply import apply_tensor_parallel

        apply_tensor_parallel(model, parallel)
    return model.eval()
