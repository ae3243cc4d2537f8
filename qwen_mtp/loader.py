"""Hugging Face checkpoint directory -> `QwenHybridForCausalLM`, keeping the `mtp.*` weights other loaders drop.

Accepts one `model.safetensors`, shards listed in `model.safetensors.index.json`, or a folder of shards; the
prefixes `model.language_model.` (VLM layout) and `model.` (text layout); ignores the vision tower. FP8 block
tensors (`weight` e4m3 + `weight_scale_inv`) are dequantized for now. Each tensor is written where the model's
name table (`QwenHybridForCausalLM.checkpoint_slots`) says: a parameter, or a segment of a merged projection.
MoE experts load from either layout: one tensor per expert (`experts.{e}.gate_proj.weight`, ...) or the
3-D `experts.gate_up_proj` / `experts.down_proj`. Every error names the tensor or file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qwen_mtp.config import ModelConfig
from qwen_mtp.dtypes import DTYPES
from qwen_mtp.errors import CheckpointError
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.quant.fp8 import dequantize_fp8_block

FLOAT_DTYPES = tuple(DTYPES.values())  # the checkpoint dtypes loaded as they are (fp8 is dequantized)
IGNORED_PREFIXES = ("model.visual.", "visual.")
SCALE_SUFFIX = "_scale_inv"


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


def _iter_tensors(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), desc="loading shards", unit="file")
    for file in files:
        with _open(file) as handle:
            for name in handle.keys():
                try:
                    yield name, handle.get_tensor(name)
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


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> QwenHybridForCausalLM:
    """Load a Qwen3.5 (dense or MoE) or Qwen3-Next checkpoint with its MTP head.

    `dtype` defaults to the checkpoint's `dtype` (else bfloat16); every parameter is cast to it, as Hugging Face
    does. A checkpoint with no `mtp.*` tensors at all loads without a head (`model.mtp is None`); one with an
    incomplete head is an error.
    """
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
    with torch.device("meta"):
        model = QwenHybridForCausalLM(config)
    expected = {name: slot.shape for name, slot in model.checkpoint_slots().items()}
    aliases = model.checkpoint_aliases()  # per-expert MoE tensors: parts of the 3-D expert weights
    expected.update({name: slot.shape for name, (_, slot) in aliases.items()})

    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for raw_name, tensor in _iter_tensors(files, progress):
        name = checkpoint_name(raw_name)
        if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if name.endswith(SCALE_SUFFIX):
            scales[name[: -len(SCALE_SUFFIX)]] = tensor
        elif name in expected:
            weights[name] = tensor
        else:
            unexpected.append(raw_name)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in checkpoint {path}: {sorted(unexpected)[:20]}")
    missing = sorted(_missing(set(expected) - set(weights), aliases))
    if missing:
        raise CheckpointError(f"missing tensors in checkpoint {path}: {missing[:20]}")

    for name, tensor in weights.items():
        if tensor.dtype == torch.float8_e4m3fn:
            if name not in scales:
                raise CheckpointError(f"fp8 tensor {name} has no {name}{SCALE_SUFFIX}")
            if config.weight_block_size is None:
                raise CheckpointError(f"fp8 tensor {name} but config.json has no quantization_config")
            tensor = dequantize_fp8_block(tensor, scales.pop(name), config.weight_block_size)
        elif tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}; expected a float dtype or fp8 e4m3")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {name} has shape {list(tensor.shape)} but the config implies {list(expected[name])}"
            )
        weights[name] = tensor
    if scales:
        raise CheckpointError(f"block scales without an fp8 weight: {sorted(scales)[:20]}")
    model = model.to(dtype).to_empty(device=device)  # every parameter in `dtype`, as Hugging Face casts them
    slots = model.checkpoint_slots() | {name: slot for name, (_, slot) in model.checkpoint_aliases().items()}
    for name in list(weights):
        slots[name].load(weights.pop(name).to(device=device, dtype=dtype))  # each host copy freed once written
    model.init_non_persistent_buffers(device)
    return model.eval()
