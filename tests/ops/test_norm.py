"""RMSNorm, the GDN's gated norm and the fused residual add + norm (`qwen_mtp::rms_norm`, `gated_rms_norm`,
`add_rms_norm`): equal to their references and batch-invariant."""

import pytest
import torch
from op_helpers import DTYPES, REAL, VERIFY_DTYPE, check_op, close, fused_projection, rand

from qwen_mtp.ops.norm import add_rms_norm_reference, gated_rms_norm_reference, norm_triton, rms_norm_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_kernels_match_reference_and_are_batch_invariant(dtype, gated):
    x, weight = rand(7, 3, 1500, dtype=dtype, seed=1), rand(1500, dtype=dtype, seed=2, scale=0.1)
    gate = rand(7, 3, 1500, dtype=dtype, seed=3) if gated else None
    ours = norm_triton(x, weight, 1e-6, gate)
    ref = gated_rms_norm_reference(x, gate, weight, 1e-6) if gated else rms_norm_reference(x, weight, 1e-6)
    close(ours, ref, dtype)
    one = norm_triton(x[2:3], weight, 1e-6, None if gate is None else gate[2:3])
    assert torch.equal(one, ours[2:3])


@pytest.mark.parametrize("width", [1500, 5120, 9000])  # one 2048 block, one 8192 block, the chunked loop
def test_norm_widths_match_reference_with_and_without_the_add(width):
    """Rows up to 8192 wide are normalized from registers in one pass, wider rows in 1024-wide chunks: both
    equal the reference, the fused add equals add then norm bitwise, and a row alone equals it in a batch."""
    x, delta = rand(3, width, seed=1), rand(3, width, seed=2)
    weight = rand(width, seed=3, scale=0.1)
    close(norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), torch.float32)
    normed, summed = norm_triton(x, weight, 1e-6, delta=delta)
    assert torch.equal(summed, x + delta) and torch.equal(normed, norm_triton(x + delta, weight, 1e-6))
    assert torch.equal(norm_triton(x[1:2], weight, 1e-6, delta=delta[1:2])[0], normed[1:2])


def test_norm_rows_invariant_real_shapes():
    k = 1024 if REAL else 64
    x = rand(40, k, dtype=VERIFY_DTYPE, seed=2)
    norm_w = rand(k, dtype=VERIFY_DTYPE, seed=3, scale=0.1)
    normed = norm_triton(x, norm_w, 1e-6)
    for rows in (slice(0, 1), slice(3, 11), slice(5, 21)):
        assert torch.equal(norm_triton(x[rows], norm_w, 1e-6), normed[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_add_then_norm_bitwise(dtype):
    """The fused residual add + norm is the separate add and norm, bit for bit, and batch-invariant."""
    x, delta = rand(5, 48, dtype=dtype, seed=1), rand(5, 48, dtype=dtype, seed=2)
    weight = rand(48, dtype=dtype, seed=3, scale=0.1)
    normed, summed = norm_triton(x, weight, 1e-6, delta=delta)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, norm_triton(x + delta, weight, 1e-6))
    ref_normed, ref_summed = add_rms_norm_reference(x, delta, weight, 1e-6)
    close(normed, ref_normed, dtype)
    one, _ = norm_triton(x[3:4], weight, 1e-6, delta=delta[3:4])
    assert torch.equal(one, normed[3:4])


def test_gated_norm_reads_strided_projection_slices():
    """The GDN's z (per-head rows of a wider projection row) goes into the kernel in place."""
    x = rand(2, 3, 4, 16, seed=1)
    z, _, _ = fused_projection(2, 3, [64, 40, 8], seed=2)
    z = z.reshape(2, 3, 4, 16)
    weight = rand(16, seed=3, scale=0.1)
    assert torch.equal(norm_triton(x, weight, 1e-6, z), norm_triton(x, weight, 1e-6, z.contiguous()))


def test_norm_ops_pass_opcheck_with_the_models_strided_inputs():
    ops = torch.ops.qwen_mtp
    x = rand(2, 3, 8, dtype=torch.float32)
    strided = rand(2, 3, 16, dtype=torch.float32)[..., :8]  # like one half of q_proj's [q | gate] chunk
    w = rand(8, dtype=torch.float32, scale=0.1)
    check_op(ops.rms_norm, (strided, w, 1e-6))
    check_op(ops.add_rms_norm, (strided, x, w, 1e-6))
    check_op(ops.gated_rms_norm, (strided, x, w, 1e-6))
    check_op(ops.gated_rms_norm, (strided, x, w, 1e-6, True))  # decode path
