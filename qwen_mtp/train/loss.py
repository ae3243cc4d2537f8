"""The training losses, read the way inference reads the model.

Next token: logits at position i predict token i+1. MTP: the head at position i takes (embedding of token i+1,
the target's post-norm hidden state at i) at the rotary position of i and predicts token i+2, exactly what the
engine's MTP prefill and first draft compute (`QwenHybridForCausalLM.mtp_logits`). `draft_acc` is how often
the head's argmax equals the target's own argmax for that token: teacher-forced first-draft acceptance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen_mtp.model import QwenHybridForCausalLM


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def positions_like(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


def joint_loss(
    model: QwenHybridForCausalLM, windows: torch.Tensor, mtp_weight: float, with_mtp: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """windows [B, T+2] -> (loss to minimise, detached parts: lm, mtp, draft_acc). Without `with_mtp` (mode
    `target`), only the next-token loss (the head is left alone)."""
    length = windows.shape[1] - 2
    inputs, labels = windows[:, :length], windows[:, 1 : length + 1]
    hidden = model.hidden_states(inputs)  # [B, T, H] post-norm
    logits = model.logits(hidden)
    lm = cross_entropy(logits, labels)
    if not with_mtp:
        return lm, {"lm": lm.detach()}
    mtp_logits = model.mtp_logits(labels, hidden, positions_like(inputs))  # [B, T, V]: token i+2
    mtp = cross_entropy(mtp_logits, windows[:, 2:])
    with torch.no_grad():
        draft_acc = (mtp_logits[:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return lm + mtp_weight * mtp, {"lm": lm.detach(), "mtp": mtp.detach(), "draft_acc": draft_acc}
