"""The chunk-parallel delta rule for prefill: the plain form (`naive.chunked_gated_delta_rule`, equal to the
recurrent one) and the Triton kernels (`qwen_mtp::gdn_chunked`)."""

import pytest
import torch
from op_helpers import DTYPES, check_op, fused_projection, naive_inputs, rand

from qwen_mtp.ops.gdn.chunked import gdn_chunked_triton
from qwen_mtp.ops.gdn.naive import chunked_gated_delta_rule, gate_values, recurrent_gated_delta_rule


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
