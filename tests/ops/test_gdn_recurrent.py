"""The token-by-token delta rule: the plain form (`naive.recurrent_gated_delta_rule`) and the decode / verify
kernel over pooled states (`qwen_mtp::gdn_recurrent`)."""

import pytest
import torch
from op_helpers import DEVICE, REAL, VERIFY_DTYPE, fused_projection, naive_inputs, rand

from qwen_mtp.ops.gdn.naive import recurrent_gated_delta_rule
from qwen_mtp.ops.gdn.recurrent import gdn_recurrent_reference, gdn_recurrent_triton


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_recurrent_split_equals_whole_bitwise(state_dtype):
    """Token-at-a-time recurrence is the same computation however the tokens are grouped into calls, and the
    per-token states are the states a one-token-at-a-time run passes along (through a bf16 pool too)."""
    q, k, v, decay, beta, state = naive_inputs(9)
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


@pytest.mark.parametrize("length", [1, 3, 5])
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_gdn_recurrent_matches_reference(length, dtype, state_dtype):
    batch, hk, hv, dk, dv = 3, 2, 4, 16, 32
    q, k = rand(batch, length, hk, dk, dtype=dtype, seed=1), rand(batch, length, hk, dk, dtype=dtype, seed=2)
    v, a, b = (
        rand(batch, length, hv, dv, dtype=dtype, seed=3),
        rand(batch, length, hv, dtype=dtype, seed=4),
        rand(batch, length, hv, dtype=dtype, seed=5),
    )
    a_log, dt_bias = rand(hv, dtype=dtype, seed=6).abs(), rand(hv, dtype=dtype, seed=7).abs()
    pool = rand(6, 6, hv, dk, dv, dtype=state_dtype, seed=8, scale=0.1)
    rows, committed = torch.tensor([5, 1, 3], device=DEVICE), torch.tensor([0, 2, 0, 4, 0, 1], device=DEVICE)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = gdn_recurrent_reference(q, k, v, a, b, a_log, dt_bias, ref_pool, rows, committed)
    tri = gdn_recurrent_triton(q, k, v, a, b, a_log, dt_bias, tri_pool, rows, committed)
    tol = 2e-3 if state_dtype == torch.bfloat16 or dtype != torch.float32 else 2e-6
    torch.testing.assert_close(tri.float(), ref.float(), rtol=tol, atol=tol)
    # states: equal up to fp32 summation order (one bf16 ulp where the pool rounds)
    bf16 = state_dtype == torch.bfloat16
    torch.testing.assert_close(
        tri_pool.float(), ref_pool.float(), rtol=1e-2 if bf16 else 1e-5, atol=4e-3 if bf16 else 1e-5
    )
    untouched = [r for r in range(6) if r not in (5, 1, 3)]
    assert torch.equal(tri_pool[untouched], pool[untouched])


@pytest.mark.parametrize("spec", [1, 3])
def test_gdn_recurrent_verify_equals_decode_steps(spec):
    batch, hk, hv, dk, dv = (8, 16, 16, 128, 128) if REAL else (3, 2, 4, 16, 32)
    length = spec + 1
    q, k = (
        rand(batch, length, hk, dk, dtype=VERIFY_DTYPE, seed=1),
        rand(batch, length, hk, dk, dtype=VERIFY_DTYPE, seed=2),
    )
    v = rand(batch, length, hv, dv, dtype=VERIFY_DTYPE, seed=3)
    a, b = rand(batch, length, hv, dtype=VERIFY_DTYPE, seed=4), rand(batch, length, hv, dtype=VERIFY_DTYPE, seed=5)
    a_log, dt_bias = rand(hv, dtype=VERIFY_DTYPE, seed=6).abs(), rand(hv, dtype=VERIFY_DTYPE, seed=7).abs()
    pool = rand(batch, spec + 1, hv, dk, dv, seed=8, scale=0.1)
    rows, committed = torch.arange(batch, device=DEVICE), torch.zeros(batch, dtype=torch.long, device=DEVICE)
    verify_pool, decode_pool = pool.clone(), pool.clone()
    verify = gdn_recurrent_triton(q, k, v, a, b, a_log, dt_bias, verify_pool, rows, committed)
    for t in range(length):
        step = slice(t, t + 1)
        decode = gdn_recurrent_triton(
            q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], a_log, dt_bias, decode_pool, rows, committed
        )
        assert torch.equal(decode[:, 0], verify[:, t]), t
        assert torch.equal(decode_pool[:, 0], verify_pool[:, t]), t


def test_gdn_recurrent_takes_strided_slices_of_one_conv_output():
    """The model hands q, k, v over as views of one [B, T, C] conv output: same result as contiguous copies."""
    batch, length, hk, hv, dk, dv = 2, 3, 2, 4, 16, 32
    q, k, v = fused_projection(batch, length, [hk * dk, hk * dk, hv * dv])
    q, k, v = q.reshape(batch, length, hk, dk), k.reshape(batch, length, hk, dk), v.reshape(batch, length, hv, dv)
    a, b = rand(batch, length, hv, seed=4), rand(batch, length, hv, seed=5)
    a_log, dt_bias = rand(hv, seed=6).abs(), rand(hv, seed=7).abs()
    pool = rand(3, 4, hv, dk, dv, seed=8, scale=0.1)
    rows, committed = torch.tensor([2, 0], device=DEVICE), torch.tensor([1, 0, 3], device=DEVICE)
    strided_pool, copied_pool = pool.clone(), pool.clone()
    strided = gdn_recurrent_triton(q, k, v, a, b, a_log, dt_bias, strided_pool, rows, committed)
    copied = gdn_recurrent_triton(
        q.contiguous(), k.contiguous(), v.contiguous(), a, b, a_log, dt_bias, copied_pool, rows, committed
    )
    assert not q.is_contiguous() and torch.equal(strided, copied) and torch.equal(strided_pool, copied_pool)
