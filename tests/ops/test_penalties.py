"""Logit bias, repetition, presence and frequency penalties and min_tokens' stop-token ban
(`qwen_mtp::apply_penalties`): the rule element by element in float32 (numpy), the kernel equal to the reference bit
for bit (counts read by state row, drafts added in the kernel), neutral values change no bit, and a row's result does
not depend on the rows beside it."""

import itertools

import numpy as np
import pytest
import torch
from op_helpers import DEVICE, check_op, rand

from qwen_mtp.ops.penalties import apply_penalties, apply_penalties_reference, apply_penalties_triton

VOCAB = 300  # not a multiple of the kernel's block


def inputs(rows=5, vocab=VOCAB, dtype=torch.float32, drafts=3, seed=0):
    """Logits [rows, V] over 4 state rows of counts and prompt tokens, each logit row with up to `drafts` drafts."""
    gen = torch.Generator().manual_seed(seed)
    logits = rand(rows, vocab, dtype=dtype, seed=seed, scale=6.0)
    counts = torch.randint(0, 4, (4, vocab), generator=gen, dtype=torch.int32) * (
        torch.rand(4, vocab, generator=gen) < 0.2
    )
    seen = torch.rand(4, vocab, generator=gen) < 0.2
    bias = torch.randn(4, vocab, generator=gen) * 3 * (torch.rand(4, vocab, generator=gen) < 0.1)
    stops = torch.rand(4, vocab, generator=gen) < 0.05
    positions = torch.randint(10, 20, (rows,), generator=gen)
    min_end = torch.randint(0, 30, (rows,), generator=gen)
    state_rows = torch.randint(0, 4, (rows,), generator=gen)
    tokens = torch.randint(0, vocab, (rows, drafts), generator=gen)
    tokens[torch.rand(rows, drafts, generator=gen) < 0.3] = -1
    tokens[0, : min(2, drafts)] = 7  # a draft token twice
    rep = torch.empty(rows).uniform_(0.5, 2.0, generator=gen)
    freq, pres = torch.empty(rows).uniform_(-2, 2, generator=gen), torch.empty(rows).uniform_(-2, 2, generator=gen)
    rep[1], freq[1], pres[1], min_end[1] = 1.0, 0.0, 0.0, 0  # an unpenalized row
    min_end[2] = positions[2] + 1  # a row whose stop tokens are banned
    parts = (logits, counts, seen, bias, stops, state_rows, tokens, positions, rep, freq, pres, min_end)
    return tuple(t.to(DEVICE) for t in parts)


def test_rule_element_by_element():
    """Each element as its own float32 operations (numpy scalars round every operation), against the reference."""
    logits, counts, seen, bias, stops, rows, drafts, positions, rep, freq, pres, min_end = args = inputs(4, 40)
    out = apply_penalties_reference(*args).cpu()
    f32 = np.float32
    for r, v in itertools.product(range(4), range(40)):
        x, b = f32(logits[r, v].item()), f32(bias[rows[r], v].item())
        if b != 0:
            x = f32(x + b)
        c = int(counts[rows[r], v]) + int((drafts[r] == v).sum())
        if seen[rows[r], v] or c > 0:
            x = x / f32(rep[r].item()) if x > 0 else x * f32(rep[r].item())
        x = f32(x - f32(freq[r].item()) * f32(c))
        x = f32(x - f32(pres[r].item()) * f32(c > 0))
        if stops[rows[r], v] and positions[r] < min_end[r]:
            x = f32("-inf")
        assert out[r, v].item() == x, (r, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("drafts", [0, 1, 4])
def test_kernel_equals_reference_bitwise(dtype, drafts):
    args = inputs(dtype=dtype, drafts=drafts, seed=drafts)
    ours = apply_penalties_triton(*args, block=128)
    assert ours.dtype == torch.float32 and torch.equal(ours, apply_penalties_reference(*args))


def test_neutral_penalties_change_no_bit():
    logits, counts, seen, bias, stops, rows, drafts, positions, *_ = inputs()
    logits[0, :4] = torch.tensor([0.0, -0.0, float("-inf"), 1e-30])
    ones, zeros = torch.ones(5, device=DEVICE), torch.zeros(5, device=DEVICE)
    for run in (apply_penalties_reference, apply_penalties_triton):
        buffers = (counts, seen, torch.zeros_like(bias), stops)
        out = run(logits, *buffers, rows, drafts, positions, ones, zeros, zeros, zeros.long())
        assert torch.equal(out.view(torch.int32), logits.view(torch.int32))


def test_a_row_alone_equals_the_row_in_a_batch():
    args = inputs(drafts=2)
    batch = apply_penalties_triton(*args, block=128)
    for r in range(5):
        logits, buffers, per_row = args[0], args[1:5], args[5:]
        one = (logits[r : r + 1], *buffers, *(t[r : r + 1] for t in per_row))
        assert torch.equal(apply_penalties_triton(*one, block=128), batch[r : r + 1])


def test_penalties_pass_opcheck():
    check_op(torch.ops.qwen_mtp.apply_penalties, inputs())
    assert torch.equal(apply_penalties(*inputs()), apply_penalties_reference(*inputs()))
