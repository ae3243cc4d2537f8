"""ModelConfig -> the layer plan: which mixer (and dense or MoE MLP) each decoder layer has, and the MTP block's
layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qwen_mtp.config import ModelConfig, MoeConfig


@dataclass(frozen=True)
class LayerSpec:
    index: int
    mixer: Literal["gdn", "attn"]
    moe: MoeConfig | None = None  # the layer's MLP is this MoE (None: the dense SwiGLU MLP)


@dataclass(frozen=True)
class ModelPlan:
    layers: tuple[LayerSpec, ...]
    mtp_layers: tuple[LayerSpec, ...]  # the MTP block: always full attention

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(spec.index for spec in self.layers if spec.mixer == "attn")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(spec.index for spec in self.layers if spec.mixer == "gdn")


def plan_model(config: ModelConfig) -> ModelPlan:
    moe = set(config.moe_layers)
    layers = tuple(LayerSpec(i, kind, config.moe if i in moe else None) for i, kind in enumerate(config.layer_types))
    # The MoE models' MTP block has the same MoE MLP as their decoder layers.
    mtp = tuple(LayerSpec(i, "attn", config.moe) for i in range(config.mtp_num_hidden_layers))
    return ModelPlan(layers, mtp)
