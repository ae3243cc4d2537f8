"""Recipe -> (model, tokenizer, device): where the weights come from and what can run today."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwen_mtp.dtypes import torch_dtype
from qwen_mtp.errors import CheckpointError, RecipeError
from qwen_mtp.loader import check_device, load_model
from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.parallel import current
from qwen_mtp.quant.fp8 import quantize_, set_fp8_decode
from qwen_mtp.recipe import Recipe


@dataclass
class LoadedModel:
    model: QwenHybridForCausalLM
    tokenizer: Any | None  # a transformers tokenizer, when the checkpoint ships one
    checkpoint: Path
    device: torch.device


def resolve_device(name: str) -> torch.device:
    """`model.device` as a torch device (`auto`: CUDA when there is one); a RecipeError for one this machine lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return check_device(name)
    except CheckpointError as err:
        raise RecipeError(f"model.device: {err}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's Hugging Face tokenizer, or None when it ships none (prompts are then token ids)."""
    files = [path / name for name in TOKENIZER_FILES if (path / name).exists()]
    if not files:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # tokenizers / transformers raise whatever their parsers trip over
        raise CheckpointError(_tokenizer_problem(path, files, err)) from None


def _tokenizer_problem(path: Path, files: list[Path], err: Exception) -> str:
    """Name the file that is not JSON (garbage bytes, truncated), else say which files failed to load and how."""
    for file in files:
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as bad:
            return f"cannot read the tokenizer file {file}: {bad}"
    names = " / ".join(file.name for file in files)
    return f"cannot load the tokenizer ({names}) in {path}: {type(err).__name__}: {err}"


def load_from_recipe(recipe: Recipe, progress: bool = False) -> LoadedModel:
    """The recipe's model; with `parallel.tp` > 1 (inside a started rank) this rank's shard, on its GPU."""
    if recipe.model.path is None and recipe.model.fixture is None and recipe.model.synthetic is None:
        raise RecipeError("model: set one of model.path, model.fixture or model.synthetic (a train recipe has none)")
    parallel = current(recipe.parallel.tp)
    device = resolve_device(recipe.model.device)
    if parallel is not None and device.type == "cuda":
        device = torch.device("cuda", parallel.local_rank)
    if recipe.model.synthetic is not None:
        from qwen_mtp.testing.synthetic import synthetic_model

        dtype = torch_dtype(recipe.model.dtype)
        model = synthetic_model(recipe.model.synthetic, dtype, device, recipe.model.seed, parallel)
        if recipe.model.quant == "fp8-block":
            quantize_(model)  # a rank quantizes its own shard
        set_fp8_decode(model, recipe.model.fp8_decode)
        return LoadedModel(model, None, Path(f"synthetic:{recipe.model.synthetic}"), device)
    if recipe.model.fixture is not None:
        from qwen_mtp.testing import fixture_path

        checkpoint = fixture_path(recipe.model.fixture, seed=recipe.model.seed)
    else:
        checkpoint = Path(recipe.model.path).expanduser()
    dtype = torch_dtype(recipe.model.dtype)
    model = load_model(
        checkpoint, dtype=dtype, device=device, progress=progress, quant=recipe.model.quant, parallel=parallel
    )
    set_fp8_decode(model, recipe.model.fp8_decode)
    return LoadedModel(model, load_tokenizer(checkpoint), checkpoint, device)
