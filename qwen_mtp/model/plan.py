"""ModelConfig -> the layer plan: which mixer each decoder layer has, and the MTP block's layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qwen_mtp.config import ModelConfig


@dataclass(frozen=True)
class LayerSpec:
    index: int
    mixer: Literal["gdn", "attn"]


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
    layers = tuple(LayerSpec(i, kind) for i, kind in enumerate(config.layer_types))
    mtp = tuple(LayerSpec(i, "attn") for i in range(config.mtp_num_hidden_layers))
    return ModelPlan(layers, mtp)
