"""MTP-head self-distillation (`train.mode: mtp-head`, `qwen-mtp train --mtp-only`): the target is frozen and
the head learns the target's own next tokens.

A draft is accepted when it equals what the target itself picks, not what the corpus says, so the label for
the head at position i is the target's greedy token after reading token i+1 (its argmax at i+1). This restores
acceptance after a fine-tune moved the target's hidden states away from what the head was trained on.
"""

from __future__ import annotations

import torch

from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.train.loss import cross_entropy, positions_like


def head_parameters(model: QwenHybridForCausalLM) -> list[torch.nn.Parameter]:
    """The MTP head's own parameters (`mtp.*`); the embedding and lm_head it shares stay the target's."""
    if model.mtp is None:
        raise ValueError("train.mode mtp-head: the model has no MTP head (mtp_num_hidden_layers = 0)")
    return list(model.mtp.parameters())


def distill_loss(model: QwenHybridForCausalLM, windows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """windows [B, T+2] -> (CE of the head against the target's greedy tokens, parts: mtp, draft_acc)."""
    length = windows.shape[1] - 2
    with torch.no_grad():
        hidden = model.hidden_states(windows[:, : length + 1])  # [B, T+1, H]
        targets = model.logits(hidden[:, 1:]).argmax(-1)  # the target's token after i+1, for i = 0..T-1
    hidden = hidden[:, :length]
    next_ids = windows[:, 1 : length + 1]
    mtp_logits = model.mtp_logits(next_ids, hidden, positions_like(next_ids))
    loss = cross_entropy(mtp_logits, targets)
    with torch.no_grad():
        draft_acc = (mtp_logits.argmax(-1) == targets).float().mean()
    return loss, {"mtp": loss.detach(), "draft_acc": draft_acc}
