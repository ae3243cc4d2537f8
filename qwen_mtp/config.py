"""Hugging Face `config.json` -> `ModelConfig`: the architecture facts the model, loader and engine need.

Reads the Qwen3.5 VLM wrapper (`qwen3_5`, the text model under `text_config`) and the bare text config
(`qwen3_5_text`); rope parameters in the v5 (`rope_parameters`) and the legacy top-level form; `layer_types` or
`full_attention_interval`. The MoE families too: Qwen3.5-MoE (`qwen3_5_moe` wrapper, `qwen3_5_moe_text`) and
Qwen3-Next (`qwen3_next`, flat), their router, experts and shared expert in `MoeConfig`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen_mtp.errors import ConfigError

DENSE_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text"}
MOE_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text", "qwen3_next": "qwen3_next"}
TEXT_TYPES = {**DENSE_TEXT_TYPES, **MOE_TYPES}  # config.json model_type -> the text model's type
WRAPPERS = ("qwen3_5", "qwen3_5_moe")  # VLM configs: the text model under `text_config`
LAYER_KINDS = {"linear_attention": "gdn", "full_attention": "attn"}


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MoE MLP: a softmax router over `num_experts` picks `top_k` (renormalised when `norm_topk_prob`),
    each expert a SwiGLU of width `intermediate_size`, plus one shared expert (width
    `shared_intermediate_size`) scaled by a sigmoid gate."""

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """The text model of a Qwen3.5 (dense or MoE) or Qwen3-Next checkpoint (the vision tower, if any, is ignored)."""

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
    moe: MoeConfig | None = None  # the MoE MLP of the layers in `moe_layers` (and of the MTP block)
    moe_layers: tuple[int, ...] = ()  # decoder layers whose MLP is `moe`; the others are dense

    @property
    def interleaved_gdn_projections(self) -> bool:
        """Qwen3-Next stores the GDN input projections grouped by key head (`in_proj_qkvz`, `in_proj_ba`)."""
        return self.model_type == "qwen3_next"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for stop tokens) from a checkpoint directory."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise ConfigError(f"{config_file} not found: is {path} a Hugging Face checkpoint directory?")
        gen_file = path / "generation_config.json"
        return cls.from_dict(_read_json(config_file), _read_json(gen_file) if gen_file.exists() else None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Parse a `config.json` object; every missing, mistyped or out-of-range key is a `ConfigError` naming it."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must be a JSON object of settings, got {type(raw).__name__}")
        if generation is not None and not isinstance(generation, dict):
            raise ConfigError(f"generation_config.json must be a JSON object, got {type(generation).__name__}")
        model_type = raw.get("model_type")
        if not isinstance(model_type, str):
            raise ConfigError(f"config.json: model_type must be a string such as 'qwen3_5', got {model_type!r}")
        if model_type not in TEXT_TYPES:
            raise ConfigError(f"unsupported model_type {model_type!r}; expected one of {sorted(TEXT_TYPES)}")
        wrapped = model_type in WRAPPERS and "text_config" in raw
        text = raw["text_config"] if wrapped else raw
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
        keys = _Keys(text, "text_config." if wrapped else "")
        text_type = keys.optional("model_type", str, TEXT_TYPES[model_type]) if wrapped else TEXT_TYPES[model_type]
        if text_type not in (TEXT_TYPES[model_type], model_type):
            raise ConfigError(
                f"config.json: text_config.model_type {text_type!r} does not belong in a {model_type!r} config "
                f"(expected {TEXT_TYPES[model_type]!r})"
            )

        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported (Qwen3.5 uses 'silu')")
        num_layers = keys.count("num_hidden_layers")
        heads = keys.count("num_attention_heads")
        kv_heads = keys.count("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        hk, hv = keys.count("linear_num_key_heads"), keys.count("linear_num_value_heads")
        if hv % hk:
            raise ConfigError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
        hidden = keys.count("hidden_size")
        head_dim = keys.count("head_dim", hidden // heads)
        rope_theta, partial = _rope(keys, _Keys(raw, ""))
        if int(head_dim * partial) % 2:
            raise ConfigError(
                f"config.json: head_dim {head_dim} * partial_rotary_factor {partial} must give an even number of "
                "rotary dimensions"
            )
        quant = raw.get("quantization_config") or text.get("quantization_config")
        moe, moe_layers = _moe(keys, text_type, num_layers)
        return cls(
            model_type=text_type,
            vocab_size=keys.count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=keys.count("intermediate_size")
            if len(moe_layers) < num_layers  # the dense width: Qwen3.5-MoE has no dense layer and no such key
            else keys.count("intermediate_size", 0, minimum=0),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=keys.positive("rms_norm_eps", 1e-6),
            max_position_embeddings=keys.count("max_position_embeddings", 32768),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            layer_types=_layer_types(keys, num_layers),
            linear_conv_kernel_dim=keys.count("linear_conv_kernel_dim", 4),
            linear_key_head_dim=keys.count("linear_key_head_dim"),
            linear_value_head_dim=keys.count("linear_value_head_dim"),
            linear_num_key_heads=hk,
            linear_num_value_heads=hv,
            # Tie if either level says so: the VLM class reads the top level, the text class text_config.
            tie_word_embeddings=_Keys(raw, "").optional("tie_word_embeddings", bool, False)
            or keys.optional("tie_word_embeddings", bool, False),
            # Qwen3-Next has no MTP-count key (vLLM reads num_nextn_predict_layers, default 1).
            mtp_num_hidden_layers=keys.count(
                "mtp_num_hidden_layers", keys.count("num_nextn_predict_layers", 1, minimum=0), minimum=0
            ),
            eos_token_ids=_eos_ids([_Keys(generation or {}, "", "generation_config.json"), keys, _Keys(raw, "")]),
            weight_block_size=_block_size(quant),
            torch_dtype=_torch_dtype(keys, _Keys(raw, "")),
            moe=moe,
            moe_layers=moe_layers,
        )


_REQUIRED = object()


class _Keys:
    """Typed reads of one JSON object (`config.json`, its `text_config`, `generation_config.json`): a key that is
    missing, of the wrong type or out of range is a `ConfigError` naming the key and the value given. `null`
    counts as absent, as Hugging Face reads it."""

    def __init__(self, values: dict[str, Any], prefix: str, file: str = "config.json"):
        self.values, self.prefix, self.file = values, prefix, file

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.values.get(key)
        if value is not None:
            return value
        if default is _REQUIRED:
            raise ConfigError(f"{self.file}: missing required key {self.prefix + key!r}")
        return default

    def bad(self, key: str, wanted: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.file}: {self.prefix}{key} must be {wanted}, got {value!r}")

    def count(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
        """An integer >= `minimum` (sizes, head counts, layer counts)."""
        value = self.raw(key, default)
        if not _is_int(value) or value < minimum:
            raise self.bad(key, f"an integer >= {minimum}", value)
        return value

    def positive(self, key: str, default: Any = _REQUIRED) -> float:
        value = self.raw(key, default)
        if not _is_number(value) or not 0 < value < math.inf:  # also refuses JSON's NaN and Infinity
            raise self.bad(key, "a positive number", value)
        return float(value)

    def optional(self, key: str, kind: type, default: Any) -> Any:
        value = self.raw(key, default)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise self.bad(key, {bool: "true or false", str: "a string"}.get(kind, kind.__name__), value)
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {file}: {err}") from None


def _rope(text: _Keys, raw: _Keys) -> tuple[float, float]:
    params = text.values.get("rope_parameters") or text.values.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise text.bad("rope_parameters", "an object", params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"rope_type {rope_type!r} is not supported yet (only the default RoPE)")
    rope = _Keys(params, text.prefix + "rope_parameters.")
    theta = rope.positive("rope_theta", text.positive("rope_theta", raw.positive("rope_theta", 10000.0)))
    partial = rope.positive("partial_rotary_factor", text.positive("partial_rotary_factor", 0.25))
    if partial > 1:
        raise rope.bad("partial_rotary_factor", "in (0, 1]", partial)
    return theta, partial


def _layer_types(text: _Keys, num_layers: int) -> tuple[str, ...]:
    names = text.values.get("layer_types")
    if names is None:
        interval = text.count("full_attention_interval", 4)
        names = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(names, list):
        raise text.bad("layer_types", f"a list of {sorted(LAYER_KINDS)}", names)
    if len(names) != num_layers:
        raise ConfigError(f"layer_types has {len(names)} entries but num_hidden_layers is {num_layers}")
    unknown = dict.fromkeys(repr(n) for n in names if not isinstance(n, str) or n not in LAYER_KINDS)
    if unknown:
        raise ConfigError(f"unknown layer_types {', '.join(unknown)}; expected {sorted(LAYER_KINDS)}")
    return tuple(LAYER_KINDS[n] for n in names)


def _moe(text: _Keys, text_type: str, num_layers: int) -> tuple[MoeConfig | None, tuple[int, ...]]:
    """The MoE MLP and which layers have it, as Hugging Face decides: Qwen3.5-MoE has it in every layer and always
    renormalises the top-k; Qwen3-Next in layer i iff num_experts > 0, i is not in `mlp_only_layers` and
    (i + 1) % decoder_sparse_step == 0, renormalising iff `norm_topk_prob`."""
    if text_type == "qwen3_5_text":
        return None, ()
    experts = text.count("num_experts", minimum=0 if text_type == "qwen3_next" else 1)
    if experts == 0:
        return None, ()
    top_k = text.count("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"config.json: num_experts_per_tok={top_k} is more than num_experts={experts}")
    moe = MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=text.count("moe_intermediate_size"),
        shared_intermediate_size=text.count("shared_expert_intermediate_size"),
        norm_topk_prob=text.optional("norm_topk_prob", bool, True) if text_type == "qwen3_next" else True,
    )
    if text_type != "qwen3_next":
        return moe, tuple(range(num_layers))
    step = text.count("decoder_sparse_step", 1)
    dense = text.raw("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(_is_int(i) for i in dense):
        raise text.bad("mlp_only_layers", "a list of layer indices", dense)
    return moe, tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _eos_ids(sources: list[_Keys]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in sources:
        value = source.values.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is None:
                continue
            if not _is_int(token) or token < 0:
                raise source.bad("eos_token_id", "a token id (an integer >= 0) or a list of them", value)
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def _torch_dtype(text: _Keys, raw: _Keys) -> str | None:
    for source in (text, raw):
        for key in ("dtype", "torch_dtype"):
            if source.values.get(key) is not None:
                return source.optional(key, str, None)
    return None


def _block_size(quant: Any) -> tuple[int, int] | None:
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8' blocks)")
    block = quant.get("weight_block_size")
    if not isinstance(block, list) or len(block) != 2 or not all(_is_int(b) and b > 0 for b in block):
        raise ConfigError(
            f"fp8 quantization_config needs weight_block_size [rows, cols], e.g. [128, 128], got {block!r}"
        )
    return block[0], block[1]
