"""Hugging Face `config.json` -> `ModelConfig`: the architecture facts the model, loader and engine need.

Reads the Qwen3.5 VLM wrapper (`qwen3_5`, the text model under `text_config`) and the bare text config
(`qwen3_5_text`); rope parameters in the v5 (`rope_parameters`) and the legacy top-level form; `layer_types` or
`full_attention_interval`. MoE families are recognised and refused until MoE lands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen_mtp.errors import ConfigError

DENSE_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text"}
MOE_TYPES = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
LAYER_KINDS = {"linear_attention": "gdn", "full_attention": "attn"}


@dataclass(frozen=True)
class ModelConfig:
    """The text model of a Qwen3.5 dense checkpoint (the vision tower, if any, is ignored)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    layer_types: tuple[str, ...]  # "gdn" | "attn" per layer
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    eos_token_ids: tuple[int, ...]
    weight_block_size: tuple[int, int] | None = None  # FP8 block checkpoints: (128, 128)
    torch_dtype: str | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the depthwise conv: `[q | k | v]` before the split."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for stop tokens) from a checkpoint directory."""
        path = Path(path)
        config_file = path / "config.json"
        try:
            raw = json.loads(config_file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{config_file} not found: is {path} a Hugging Face checkpoint directory?") from None
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read {config_file}: {err}") from None
        generation = {}
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            try:
                generation = json.loads(gen_file.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ConfigError(f"cannot read {gen_file}: {err}") from None
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type in MOE_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} (MoE) is recognised but not supported yet; "
                "qwen-mtp currently runs the dense Qwen3.5 models (qwen3_5, qwen3_5_text)"
            )
        if model_type not in DENSE_TEXT_TYPES:
            raise ConfigError(f"unsupported model_type {model_type!r}; expected one of {sorted(DENSE_TEXT_TYPES)}")
        text = raw.get("text_config", raw) if model_type == "qwen3_5" else raw
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
        if text.get("model_type", "qwen3_5_text") in MOE_TYPES:
            raise ConfigError(f"text_config.model_type {text['model_type']!r} (MoE) is not supported yet")

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config.json: missing required key {key!r}")
            return text[key]

        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported (Qwen3.5 uses 'silu')")
        num_layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(text.get("num_key_value_heads", heads))
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        hk, hv = int(need("linear_num_key_heads")), int(need("linear_num_value_heads"))
        if hv % hk:
            raise ConfigError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
        hidden = int(need("hidden_size"))
        rope_theta, partial = _rope(text, raw)
        quant = raw.get("quantization_config") or text.get("quantization_config")
        return cls(
            model_type=DENSE_TEXT_TYPES[model_type],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            layer_types=_layer_types(text, num_layers),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_num_key_heads=hk,
            linear_num_value_heads=hv,
            # Tie if either level says so: the VLM class reads the top level, the text class text_config.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 1)),
            eos_token_ids=_eos_ids(text, raw, generation or {}),
            weight_block_size=_block_size(quant),
            torch_dtype=text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype"),
        )


def _rope(text: dict[str, Any], raw: dict[str, Any]) -> tuple[float, float]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"rope_type {rope_type!r} is not supported yet (only the default RoPE)")
    theta = params.get("rope_theta", text.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return float(theta), float(partial)


def _layer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    names = text.get("layer_types")
    if names is None:
        interval = int(text.get("full_attention_interval", 4))
        names = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(names) != num_layers:
        raise ConfigError(f"layer_types has {len(names)} entries but num_hidden_layers is {num_layers}")
    unknown = sorted(set(names) - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(f"unknown layer_types {unknown}; expected {sorted(LAYER_KINDS)}")
    return tuple(LAYER_KINDS[n] for n in names)


def _eos_ids(text: dict[str, Any], raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation, text, raw):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def _block_size(quant: dict[str, Any] | None) -> tuple[int, int] | None:
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8' blocks)")
    block = quant.get("weight_block_size")
    if not block or len(block) != 2:
        raise ConfigError("fp8 quantization_config needs weight_block_size [rows, cols], e.g. [128, 128]")
    return int(block[0]), int(block[1])
