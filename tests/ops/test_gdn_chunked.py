"""The chunk-parallel delta rule for prefill: the plain form (`naive.chunked_gated_delta_rule`, equal to the
recurrent one) and the Triton kernels (`qwen_mtp::gdn_chunked`)."""

import pytest
import torch
from op_helpers import DTYPES, check_op, fused_projection, naive_inputs, rand

from qwen_mtp.ops.gdn import chunked
from qwen_mtp.ops.gdn.chunked import gdn_chunked_triton
from qwen_mtp.ops.gdn.naive import (
    chunked_gated_delta_rule,
    chunked_gated_delta_rule_varlen,
    gate_values,
    recurrent_gated_delta_rule,
)


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(length, with_state):
    """The chunked and recurrent references agree, with GVA, initial states and ragged chunks."""
    q, k, v, decay, beta, state = naive_inputs(length)
    init = state if with_state else None
    out_c, final_c = chunked_gated_delta_rule(q, k, v, decay, beta, initial_state=init)
    out_r, states_r = recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=init)
    assert states_r.shape == (2, length, 4, 16, 8)
    torch.testing.assert_close(out_c, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final_c, states_r[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length,with_state", [(1, False), (37, True), (64, False), (130, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_chunked_prefill_matches_reference(length, with_state, dtype):
    """The prefill kernels (own chunking: prepare + scan) against the torch chunked form, with GVA, ragged last
    chunks, an initial state, and q/k/v as strided slices of one conv output (as the model passes them)."""
    batch, hk, hv, dk, dv = 2, 2, 4, 16, 32
    q, k, v = fused_projection(batch, length, [hk * dk, hk * dk, hv * dv], dtype)
    q, k, v = q.view(batch, length, hk, dk), k.view(batch, length, hk, dk), v.view(batch, length, hv, dv)
    g, beta = gate_values(rand(batch, length, hv, seed=2), rand(batch, length, hv, dtype=dtype, seed=3),
                          rand(hv, seed=4).abs(), rand(hv, seed=5).abs())  # fmt: skip
    state = rand(batch, hv, dk, dv, seed=6, scale=0.1) if with_state else None
    out, final = gdn_chunked_triton(q, k, v, g, beta, state)
    ref_out, ref_final = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    assert out.dtype == ref_out.dtype and final.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(final, ref_final, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("with_state", [False, True])
def test_gdn_chunked_passes_opcheck_on_slices_of_one_conv_output(with_state):
    gq, gk, gv = (t.view(1, 5, -1, 8) for t in fused_projection(1, 5, [16, 16, 32], seed=11))
    decay, beta = -rand(1, 5, 4, seed=12).abs(), rand(1, 5, 4, seed=13).sigmoid()
    initial = rand(1, 4, 8, 8, seed=14) if with_state else None
    check_op(torch.ops.qwen_mtp.gdn_chunked, (gq, gk, gv, decay, beta, initial))


def _sequence(length, hk=2, hv=4, dk=16, dv=32, dtype=torch.float32, seed=0):
    """q, k, v, g, beta of one sequence [T, ...] (q, k, v slices of one conv output) and an initial state."""
    q, k, v = fused_projection(1, length, [hk * dk, hk * dk, hv * dv], dtype, seed=seed + 1)
    q, k, v = q.view(length, hk, dk), k.view(length, hk, dk), v.view(length, hv, dv)
    g, beta = gate_values(rand(length, hv, seed=seed + 2), rand(length, hv, dtype=dtype, seed=seed + 3),
                          rand(hv, seed=4).abs(), rand(hv, seed=5).abs())  # fmt: skip
    return q, k, v, g, beta, rand(hv, dk, dv, seed=seed + 6, scale=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_prefill_kernel_matches_its_reference(dtype):
    """Each of the five kernels' results (the scratch they leave) against `chunk_stages`, its plain-torch
    reference: one sequence of three chunks, the last ragged, with an initial state and GVA; bf16 inputs take the
    kernels' bf16 tensor-core products on the GPU, and stay within fp32 rounding of the reference."""
    q, k, v, g, beta, state = _sequence(130, dtype=dtype)
    cu = torch.tensor([0, 130], dtype=torch.int32, device=q.device)
    out, final, parts = chunked._launch(q, k, v, g.contiguous(), beta.contiguous(), cu, 3, state[None])
    expected = chunked.chunk_stages(q, k, v, g, beta, state)
    tol = 2e-5 if dtype == torch.float32 else 8e-3  # the output rounded to bf16 (2^-8 relative) or not
    for name in ("cum", "a", "inverse", "w", "u", "states", "delta"):
        mine = parts[name] if name != "inverse" else parts[name].tril()  # `invert` leaves T's upper blocks unset
        torch.testing.assert_close(mine, expected[name], rtol=2e-5, atol=2e-5, msg=name)
    torch.testing.assert_close(out.float(), expected["out"], rtol=tol, atol=tol)
    torch.testing.assert_close(final[0], expected["final"], rtol=2e-5, atol=2e-5)


def test_packed_sequences_equal_single_calls_bitwise():
    """Sequences packed with `cu_seqlens` (an empty one, ragged chunks, one shorter than a chunk, each with its own
    initial state) get bitwise the results of each alone, and those match the reference; a batch of two equal
    lengths equals its rows alone (batch invariance of the dense entry point)."""
    lengths = [37, 0, 64, 70, 1]
    seqs = [_sequence(n, seed=10 * i) for i, n in enumerate(lengths)]
    packed = [torch.cat([s[i] for s in seqs])[None] for i in range(5)]
    states = torch.stack([s[5] for s in seqs])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=states.device)
    out, final = chunked.gdn_chunked_varlen_triton(*packed, cu, states)
    ref_out, ref_final = chunked_gated_delta_rule_varlen(*packed, cu, initial_state=states)
    torch.testing.assert_close(out, ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final, ref_final, rtol=2e-5, atol=2e-5)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone = torch.tensor([0, end - start], dtype=torch.int32, device=cu.device)
        out_1, final_1 = chunked.gdn_chunked_varlen_triton(*(t[None] for t in seqs[n][:5]), alone, states[n : n + 1])
        assert torch.equal(out[:, start:end], out_1) and torch.equal(final[n], final_1[0])
    batch = [torch.stack([seqs[2][i], _sequence(64, seed=99)[i]]) for i in range(6)]
    out_b, final_b = chunked.gdn_chunked_triton(*batch[:5], batch[5])
    out_0, final_0 = chunked.gdn_chunked_triton(*(t[:1] for t in batch[:5]), batch[5][:1])
    assert torch.equal(out_b[:1], out_0) and torch.equal(final_b[:1], final_0)


def test_gdn_chunked_varlen_passes_opcheck():
    q, k, v, g, beta, state = _sequence(9)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=q.device)
    args = (q[None], k[None], v[None], g[None], beta[None], cu, torch.stack([state, state * 0.5]))
    check_op(torch.ops.qwen_mtp.gdn_chunked_varlen, args)
