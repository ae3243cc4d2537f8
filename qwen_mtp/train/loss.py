"""The training losses, read the way inference reads the model.

Next token: logits at position i predict token i+1. MTP draft step 1: the head at position i takes (embedding of
token i+1, the target's post-norm hidden state at i) at the rotary position of i and predicts token i+2, exactly
what the engine's MTP prefill and first draft compute (`QwenHybridForCausalLM.mtp_logits`). With
`train.mtp_chain` = n > 1, draft steps 2..n are trained too, as the engine chains them: step s+1 for origin i
runs at position i+s on (token i+s+1, the head's own post-norm output of step s) and predicts token i+s+2. All
origins of a step run as one sequence, so a chained step attends over chained entries where the engine's draft
attends over entries the catch-up wrote from target hidden states: an approximation for steps >= 2 only.
`draft_acc` is how often step 1's argmax equals the target's own argmax for that token (teacher-forced
first-draft acceptance).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from qwen_mtp.model import QwenHybridForCausalLM


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def draft_steps(
    model: QwenHybridForCausalLM, windows: torch.Tensor, hidden: torch.Tensor, chain: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(s, logits [B, T, V]) for draft steps s = 0..chain-1 over every origin i = 0..T-1: step s predicts token
    i+s+2. `windows` [B, >= T+chain+1] tokens, `hidden` [B, T, H] the target's post-norm hidden states."""
    batch, length = hidden.shape[:2]
    origins = torch.arange(length, device=hidden.device).expand(batch, length)
    for s in range(chain):
        hidden = model.mtp_hidden_states(windows[:, s + 1 : s + 1 + length], hidden, origins + s)
        yield s, model.logits(hidden)


def joint_loss(
    model: QwenHybridForCausalLM, windows: torch.Tensor, mtp_weight: float, chain: int = 1, with_mtp: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """windows [B, T+chain+1] -> (loss to minimise, detached parts: lm, mtp (step 1), mtp_chain (steps >= 2),
    draft_acc). loss = lm + mtp_weight * mean over the steps; without `with_mtp` (mode `target`) lm alone."""
    length = windows.shape[1] - 1 - chain
    hidden = model.hidden_states(windows[:, :length])  # [B, T, H] post-norm
    logits = model.logits(hidden)
    lm = cross_entropy(logits, windows[:, 1 : length + 1])
    if not with_mtp:
        return lm, {"lm": lm.detach()}
    losses, parts = [], {"lm": lm.detach()}
    for s, mtp_logits in draft_steps(model, windows, hidden, chain):
        losses.append(cross_entropy(mtp_logits, windows[:, s + 2 : s + 2 + length]))
        if s == 0:
            with torch.no_grad():
                parts["draft_acc"] = (mtp_logits[:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    parts["mtp"] = losses[0].detach()
    if chain > 1:
        parts["mtp_chain"] = (sum(losses[1:]) / (chain - 1)).detach()
    return lm + mtp_weight * sum(losses) / chain, parts
