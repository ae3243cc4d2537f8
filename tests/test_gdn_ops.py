"""The chunked and recurrent gated-delta-rule references agree, with GVA, initial states and ragged chunks."""

import pytest
import torch
import torch.nn.functional as F

from qwen_mtp.ops.conv import causal_conv1d
from qwen_mtp.ops.gdn import chunked_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(length, hk=2, hv=4, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, length, hk, dk, generator=g)
    k = torch.randn(2, length, hk, dk, generator=g)
    v = torch.randn(2, length, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(2, length, hv, generator=g))
    beta = torch.rand(2, length, hv, generator=g)
    state = torch.randn(2, hv, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(length, with_state):
    q, k, v, decay, beta, state = _inputs(length)
    init = state if with_state else None
    out_c, final_c = chunked_gated_delta_rule(q, k, v, decay, beta, initial_state=init)
    out_r, states_r = recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=init)
    assert states_r.shape == (2, length, 4, 16, 8)
    torch.testing.assert_close(out_c, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final_c, states_r[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_recurrent_split_equals_whole_bitwise(state_dtype):
    """Token-at-a-time recurrence is the same computation however the tokens are grouped into calls, and the
    per-token states are the states a one-token-at-a-time run passes along (through a bf16 pool too)."""
    q, k, v, decay, beta, state = _inputs(9)
    whole, states = recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=state, state_dtype=state_dtype)
    s, outs = state, []
    for t in range(9):
        step = slice(t, t + 1)
        o, s = recurrent_gated_delta_rule(
            q[:, step], k[:, step], v[:, step], decay[:, step], beta[:, step], s, state_dtype=state_dtype
        )
        s = s[:, 0] if state_dtype is None else s[:, 0].to(state_dtype)  # through the pool
        assert torch.equal(s.float(), states[:, t])
        outs.append(o)
    assert torch.equal(torch.cat(outs, 1), whole)


def test_causal_conv_window_continuation():
    x = torch.randn(2, 6, 20)
    w = torch.randn(6, 4)
    whole, inputs = causal_conv1d(x, w)
    assert torch.equal(inputs[..., 3:], x) and not inputs[..., :3].any()
    first, inputs = causal_conv1d(x[..., :11], w)
    rest = [first]
    for t in range(11, 20):
        out, inputs = causal_conv1d(x[..., t : t + 1], w, inputs[..., -3:])
        rest.append(out)
        assert torch.equal(inputs, x[..., t - 3 : t + 1])
    torch.testing.assert_close(torch.cat(rest, -1), whole, rtol=1e-6, atol=1e-6)
