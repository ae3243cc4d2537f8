"""What training writes: the Hugging Face checkpoint directory (config, safetensors with the `mtp.*` tensors
under their real names, tokenizer) and the resume point (weights, optimizer, step, RNG) of an unfinished run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.train.tokenizer import TOKENIZER_FILES


def save_checkpoint(
    model: QwenHybridForCausalLM, config: dict[str, Any], tokenizer_dir: Path, out_dir: Path, dtype: str
) -> Path:
    """Write `out_dir` as a checkpoint that `load_model` and `transformers.AutoModelForCausalLM` both load:
    `config.json`, `generation_config.json`, `model.safetensors` (HF text names, `dtype`), tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    tensors = {name: t.detach().to("cpu", torch_dtype).clone() for name, t in model.state_dict().items()}
    partial = out_dir / "model.safetensors.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n")
    generation = {"eos_token_id": config["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if tokenizer_dir.resolve() != out_dir.resolve():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir


def save_resume(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary file, then rename: a run cut while saving keeps its previous resume point."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def load_resume(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
