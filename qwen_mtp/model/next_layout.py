"""Qwen3-Next's GDN input projections as its checkpoints store them, mapped onto our fused layout.

Qwen3-Next stores `in_proj_qkvz` [2*Hk*dk + 2*Hv*dv, H] grouped by key head (per head g: q_g, k_g, then the
r = Hv/Hk value heads' v and z) and `in_proj_ba` [2*Hv, H] likewise (per g: b_g, a_g). Qwen3.5 stores
`in_proj_qkv` ([q | k | v], head-major), `in_proj_z`, `in_proj_b`, `in_proj_a`. The mixer computes the same
function either way, so a Next model keeps Qwen3.5's fused weight (one GDN code path, the conv reading
[q | k | v] as it is) and only its name table differs: each Next tensor is a fixed permutation of the fused
weight's rows, applied when loading and undone for `state_dict`. A row permutation changes no product, so the
outputs are those of the interleaved projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qwen_mtp.model.gdn import GatedDeltaNet
from qwen_mtp.model.weights import WeightSlot


@dataclass(frozen=True)
class PermutedSlot(WeightSlot):
    """A checkpoint tensor whose row i is row `rows[i]` of the module's parameter `name` (scattered rows: reads
    are copies)."""

    rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.name)[self.rows.to(getattr(self.module, self.name).device)]

    def grad(self) -> torch.Tensor | None:
        grad = getattr(self.module, self.name).grad
        return None if grad is None else grad[self.rows.to(grad.device)]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *getattr(self.module, self.name).shape[1:])

    @torch.no_grad()
    def load(self, value: torch.Tensor) -> None:
        weight = getattr(self.module, self.name)
        weight[self.rows.to(weight.device)] = value.to(weight.dtype)


def interleaved_rows(mixer: GatedDeltaNet) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the fused in_proj weight ([qkv | z | b | a]) in the order of Next's `in_proj_qkvz` and `in_proj_ba`."""
    segments = mixer.in_proj.rows
    hk = mixer.key_dim // mixer.dk
    hv = mixer.value_dim // mixer.dv
    r = hv // hk
    qkv, z = segments["in_proj_qkv"].start, segments["in_proj_z"].start
    b, a = segments["in_proj_b"].start, segments["in_proj_a"].start
    qkvz, ba = [], []
    for g in range(hk):
        qkvz += range(qkv + g * mixer.dk, qkv + (g + 1) * mixer.dk)  # q_g
        qkvz += range(qkv + mixer.key_dim + g * mixer.dk, qkv + mixer.key_dim + (g + 1) * mixer.dk)  # k_g
        v = qkv + 2 * mixer.key_dim
        qkvz += range(v + g * r * mixer.dv, v + (g + 1) * r * mixer.dv)  # v of value heads g*r .. g*r+r-1
        qkvz += range(z + g * r * mixer.dv, z + (g + 1) * r * mixer.dv)  # their z
        ba += range(b + g * r, b + (g + 1) * r)
        ba += range(a + g * r, a + (g + 1) * r)
    return torch.tensor(qkvz), torch.tensor(ba)


def interleaved_gdn_slots(model: torch.nn.Module, slots: dict[str, WeightSlot]) -> dict[str, WeightSlot]:
    """`slots` with every GDN layer's in_proj_{qkv,z,b,a} replaced, in place, by Next's in_proj_qkvz and
    in_proj_ba."""
    mixers = {m.in_proj: (path, m) for path, m in model.named_modules() if isinstance(m, GatedDeltaNet)}
    out: dict[str, WeightSlot] = {}
    for name, slot in slots.items():
        if slot.module not in mixers:
            out[name] = slot
        elif slot.segment == "in_proj_qkv":  # the first of the four: the two Next tensors take their place
            path, mixer = mixers[slot.module]
            qkvz, ba = interleaved_rows(mixer)
            out[f"{path}.in_proj_qkvz.weight"] = PermutedSlot(mixer.in_proj, "weight", rows=qkvz)
            out[f"{path}.in_proj_ba.weight"] = PermutedSlot(mixer.in_proj, "weight", rows=ba)
    return out
