"""Write random-weight checkpoints in the real Hugging Face layout, MTP head included.

Both our loader and `transformers.AutoModelForCausalLM.from_pretrained` read what this writes, so tests can
compare the two on identical files. Weights are random but scaled so activations stay O(1) through the stack.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qwen_mtp.config import ModelConfig
from qwen_mtp.dtypes import torch_dtype
from qwen_mtp.quant.fp8 import quantize_fp8_block
from qwen_mtp.testing.tokenizer import build_tokenizer

FIXTURE_DTYPES = ("float32", "bfloat16")  # what the fixtures are written in
FIXTURE_VERSION = 3  # bump when the builder's output changes, so cached fixtures are rebuilt

_TINY: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    # 4 layers (3 GDN + 1 attention), GQA 4/2, Hv = 2 * Hk, untied lm_head.
    "tiny": {},
    "tiny-tied": {"tie_word_embeddings": True},
    # 8 layers given as an explicit layer_types list, MQA (4 query heads, 1 KV head), Hv = 3 * Hk.
    "tiny-8l": {
        "num_hidden_layers": 8,
        "full_attention_interval": None,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "num_key_value_heads": 1,
        "linear_num_value_heads": 6,
        "intermediate_size": 160,
    },
    # Qwen3.5-MoE (every layer MoE, top-k always renormalised; no dense intermediate_size): 8 experts, top-2.
    "tiny-moe": {
        "model_type": "qwen3_5_moe_text",
        "intermediate_size": None,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    # Qwen3-Next (flat config, legacy top-level rope keys, no MTP-count key, interleaved GDN projections):
    # 10 experts (not a power of two), top-3, layer 1 a dense MLP through mlp_only_layers.
    "tiny-next": {
        "model_type": "qwen3_next",
        "rope_parameters": None,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mtp_num_hidden_layers": None,
        "mtp_use_dedicated_embeddings": None,
        "intermediate_size": 96,
        "num_experts": 10,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    # Multiples of 128 on the quantized matrices, for FP8 block checkpoints.
    "tiny-fp8": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "head_dim": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
    },
    # Qwen3.5-MoE in FP8 blocks: tiny-moe's 8 experts, top-2, with 128-multiple matrices (the experts' gate and up
    # scale grids stack, as in Qwen's releases).
    "tiny-moe-fp8": {
        "model_type": "qwen3_5_moe_text",
        "intermediate_size": None,
        "hidden_size": 128,
        "head_dim": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    },
}

FP8_PRESETS = ("tiny-fp8", "tiny-moe-fp8")  # fixtures written as FP8 block checkpoints

# Matrices that Qwen's FP8 releases store as e4m3 blocks; everything else stays bf16 (modules_to_not_convert).
FP8_SUFFIXES = (
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "out_proj.weight",
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "in_proj_qkvz.weight",
)

# The Hugging Face causal-LM class of each text model type (config.json `architectures`, text layout).
TEXT_ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
# The VLM layout's wrapper (config model_type, class) of the text model types that have one.
VLM_WRAPPERS = {
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
}
EXPERT_LAYOUTS = ("fused", "per_expert")
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the 3-D expert weights (fused layout)


def preset_text_config(preset: str, **overrides: Any) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    config = copy.deepcopy(_TINY)
    config.update(copy.deepcopy(PRESETS[preset]))
    config.update(overrides)
    return {k: v for k, v in config.items() if v is not None}


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """fp32 random tensors for every parameter of the model (HF text names), MTP head included."""
    from qwen_mtp.model import QwenHybridForCausalLM

    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in QwenHybridForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    weights = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("A_log"):
            tensor = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            tensor = torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            tensor = 1.0 + normal(shape, 0.1)  # plain-weight gated norm
        elif name.endswith("norm.weight") or "norm_" in name:
            tensor = normal(shape, 0.1)  # zero-centred (1 + w) norms
        elif name.endswith("embed_tokens.weight"):
            tensor = normal(shape, 0.5)
        elif name.endswith("conv1d.weight"):
            tensor = normal(shape, 1.0 / math.sqrt(shape[-1]))
        else:  # linear [out, in], or 3-D experts [E, out, in]
            tensor = normal(shape, 1.0 / math.sqrt(shape[-1]))
        weights[name] = tensor
    return weights


def _per_expert(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A 3-D expert weight as one tensor per expert (what Qwen3-Next and the FP8 releases store)."""
    base, _, kind = name.rpartition(".")
    if kind == "down_proj":
        return {f"{base}.{e}.down_proj.weight": value[e] for e in range(value.shape[0])}
    gate, up = value.chunk(2, dim=1)
    parts = (("gate_proj", gate), ("up_proj", up))
    return {f"{base}.{e}.{proj}.weight": part[e] for e in range(value.shape[0]) for proj, part in parts}


def _disk_name(name: str, layout: str) -> str:
    if layout == "vlm" and name.startswith("model."):
        return "model.language_model." + name[len("model.") :]
    return name


def build_checkpoint(
    path: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    layout: str = "text",
    fp8: bool = False,
    shards: int = 1,
    experts: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a checkpoint directory: config.json, generation_config.json, safetensors (sharded with an index
    when `shards > 1`), `mtp.*` tensors with their real names, and a small local tokenizer.

    layout "text" is what HF's text class saves (`model.layers...`, model_type qwen3_5_text); "vlm" is the
    released Qwen3.5 layout (`model.language_model.layers...`, `text_config` inside a `qwen3_5` config, plus a
    vision tensor that loaders must ignore). fp8 stores the big matrices as e4m3 with 128x128 block scales.
    MoE presets: `experts` "fused" writes the 3-D `mlp.experts.gate_up_proj` / `down_proj` (the Qwen3.5-MoE
    bf16 releases), "per_expert" one tensor per expert and projection (Qwen3-Next, the FP8 releases, and
    what transformers saves); the default is each family's release layout.
    """
    if layout not in ("text", "vlm"):
        raise ValueError(f"layout must be 'text' or 'vlm', got {layout!r}")
    if experts is not None and experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {list(EXPERT_LAYOUTS)}, got {experts!r}")
    if dtype not in FIXTURE_DTYPES:
        raise ValueError(f"dtype must be one of {list(FIXTURE_DTYPES)}, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = preset_text_config(preset, **config_overrides)
    eos_id = build_tokenizer(path, text["vocab_size"])
    text["eos_token_id"] = eos_id
    text["dtype"] = dtype
    text_type = text["model_type"]
    if layout == "vlm":
        if text_type not in VLM_WRAPPERS:
            raise ValueError(f"{text_type} has no VLM layout; use layout='text'")
        wrapper, architecture = VLM_WRAPPERS[text_type]
        config: dict[str, Any] = {
            "model_type": wrapper,
            "architectures": [architecture],
            "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "dtype": dtype,
        }
    else:
        config = {"architectures": [TEXT_ARCHITECTURES[text_type]], **text}
    model_config = ModelConfig.from_dict(config)
    experts = experts or ("per_expert" if text_type == "qwen3_next" else "fused")

    dtype_of_tensors = torch_dtype(dtype)
    tensors: dict[str, torch.Tensor] = {}
    weights = random_weights(model_config, seed)
    if experts == "per_expert":
        weights = {
            part: tensor
            for name, value in weights.items()
            for part, tensor in (_per_expert(name, value) if name.endswith(EXPERT_WEIGHTS) else {name: value}).items()
        }
    for name, value in weights.items():
        disk = _disk_name(name, layout)
        if fp8 and value.ndim == 2 and name.endswith(FP8_SUFFIXES):
            q, scale = quantize_fp8_block(value)
            tensors[disk], tensors[disk + "_scale_inv"] = q, scale.to(torch.bfloat16)  # bf16, as Qwen's releases
        elif fp8 and name.endswith(EXPERT_WEIGHTS):  # 3-D experts: each expert's blocks, stacked (HF's FP8Experts)
            pairs = [quantize_fp8_block(expert) for expert in value]
            tensors[disk] = torch.stack([q for q, _ in pairs])
            tensors[disk + "_scale_inv"] = torch.stack([scale for _, scale in pairs]).to(torch.bfloat16)
        else:
            tensors[disk] = value.to(dtype_of_tensors).contiguous()
    if layout == "vlm":
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2, dtype=dtype_of_tensors)
    if fp8:
        quantized = FP8_SUFFIXES + EXPERT_WEIGHTS + ("_scale_inv",)
        kept = sorted({n.rsplit(".", 1)[0] for n in tensors if not n.endswith(quantized)})
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": kept,
        }
    _write_safetensors(path, tensors, shards)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "do_sample": False}))
    return path


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def cache_root() -> Path:
    root = os.environ.get("QWEN_MTP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen-mtp"
    )
    return Path(root)


def fixture_path(preset: str = "tiny", seed: int = 0, dtype: str = "float32", layout: str = "text") -> Path:
    """A cached fixture checkpoint, built on first use (atomically, so concurrent users never see half of it).
    FP8 presets (`FP8_PRESETS`) are FP8 block checkpoints."""
    target = cache_root() / "fixtures" / f"{preset}-seed{seed}-{dtype}-{layout}-v{FIXTURE_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build_checkpoint(staging, preset=preset, seed=seed, dtype=dtype, layout=layout, fp8=preset in FP8_PRESETS)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
