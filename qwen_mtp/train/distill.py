"""MTP-head self-distillation (`train.mode: mtp-head`, `qwen-mtp train --mtp-only`): the target is frozen and
the head learns the target's own next tokens.

A draft is accepted when it equals what the target itself picks, not what the corpus says, so the label of
draft step s at origin i is the target's greedy token after reading the tokens up to i+s+1 (its argmax at
i+s+1). This restores acceptance after a fine-tune moved the target's hidden states away from what the head
was trained on.
"""

from __future__ import annotations

import torch

from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.train.loss import cross_entropy, draft_steps


def head_parameters(model: QwenHybridForCausalLM) -> list[torch.nn.Parameter]:
    """The MTP head's own parameters (`mtp.*`); the embedding and lm_head it shares stay the target's."""
    if model.mtp is None:
        raise ValueError("train.mode mtp-head: the model has no MTP head (mtp_num_hidden_layers = 0)")
    return list(model.mtp.parameters())


def distill_loss(
    model: QwenHybridForCausalLM, windows: torch.Tensor, chain: int = 1
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """windows [B, T+chain+1] -> (mean CE of the draft steps against the target's greedy tokens, parts: mtp
    (step 1), mtp_chain (steps >= 2), draft_acc (step 1))."""
    length = windows.shape[1] - 1 - chain
    with torch.no_grad():
        hidden = model.hidden_states(windows[:, : length + chain])  # [B, T+chain, H]
        greedy = model.logits(hidden[:, 1:]).argmax(-1)  # [B, T+chain-1]: the target's token after i+1
    losses, parts = [], {}
    for s, mtp_logits in draft_steps(model, windows, hidden[:, :length], chain):
        targets = greedy[:, s : s + length]
        losses.append(cross_entropy(mtp_logits, targets))
        if s == 0:
            with torch.no_grad():
                parts["draft_acc"] = (mtp_logits.argmax(-1) == targets).float().mean()
    parts["mtp"] = losses[0].detach()
    if chain > 1:
        parts["mtp_chain"] = (sum(losses[1:]) / (chain - 1)).detach()
    return sum(losses) / chain, parts
