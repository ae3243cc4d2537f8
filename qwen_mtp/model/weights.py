"""Hugging Face tensor names -> where the model keeps each tensor. One table serves `state_dict`,
`load_state_dict` and the checkpoint loader, so the checkpoint's names survive the fused weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qwen_mtp.model.linear import Linear, MergedLinear


@dataclass(frozen=True)
class WeightSlot:
    """One checkpoint tensor's home: a parameter (or persistent buffer) `name` of `module`, or, for a
    `MergedLinear`, its `segment` of the fused weight."""

    module: nn.Module
    name: str
    segment: str | None = None

    def tensor(self) -> torch.Tensor:
        """The stored values (for a segment: a view of its rows of the fused weight or block scales)."""
        if self.segment is not None:
            return self.module.segment_tensor(self.name, self.segment)
        return getattr(self.module, self.name)

    def grad(self) -> torch.Tensor | None:
        """The gradient of these values after a backward (for a segment: its rows of the fused weight's)."""
        grad = getattr(self.module, self.name).grad
        if grad is None or self.segment is None:
            return grad
        return grad[self.module.rows[self.segment]]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor().shape)

    @torch.no_grad()
    def load(self, value: torch.Tensor) -> None:
        """Copy `value` (same shape; cast to the stored dtype and device) into the model."""
        if self.name == "weight_scale_inv":
            self.module.scale_loader(value, self.segment)
        elif self.segment is not None:
            self.module.weight_loader(value, self.segment)
        elif isinstance(self.module, Linear):
            self.module.weight_loader(value)
        else:
            self.tensor().copy_(value)


def weight_slots(model: nn.Module) -> dict[str, WeightSlot]:
    """Every tensor a checkpoint of `model` holds, by its Hugging Face name, in module order. A MergedLinear
    `<parent>.<module>` holds `<parent>.<segment>.weight` for each segment (`...linear_attn.in_proj` ->
    `...linear_attn.in_proj_qkv.weight`, ...), and, for its FP8 segments, `<parent>.<segment>.weight_scale_inv`
    (its segments kept in the model dtype are `.weight` too, stored in `unquantized_weight`); everything else
    keeps its module path (an FP8 `Linear`: `.weight` and `.weight_scale_inv`)."""
    slots: dict[str, WeightSlot] = {}
    for key in nn.Module.state_dict(model, keep_vars=True):  # the plain module tree's names
        path, _, name = key.rpartition(".")
        module = model.get_submodule(path)
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            tensor = "weight" if name == "unquantized_weight" else name  # the checkpoint's name for it
            for segment in module.stored_segments(name):
                slots[f"{parent}.{segment}.{tensor}" if parent else f"{segment}.{tensor}"] = WeightSlot(
                    module, name, segment
                )
        else:
            slots[key] = WeightSlot(module, name)
    return slots


def checkpoint_aliases(model: nn.Module) -> dict[str, tuple[str, WeightSlot]]:
    """Other layouts a checkpoint may store some tensors in: alias name -> (the `weight_slots` name it is part of,
    its slot). Today the per-expert MoE tensors (`...mlp.experts.{e}.gate_proj.weight`) of the 3-D expert weights
    (`...mlp.experts.gate_up_proj`); a module offers them with `checkpoint_aliases(prefix)`."""
    aliases: dict[str, tuple[str, WeightSlot]] = {}
    for path, module in model.named_modules():
        offered = getattr(module, "checkpoint_aliases", None)
        if path and callable(offered) and isinstance(module, nn.Module) and module is not model:
            for name, slot in offered(path).items():
                aliases[name] = (f"{path}.{slot.name}", slot)
    return aliases
