"""RMSNorm, the GDN's gated norm and the fused residual add + norm (`qwen_mtp::rms_norm`, `gated_rms_norm`,
`add_rms_norm`): equal to their references and batch-invariant; with their output's W8A8 quantization
(`norm_w8a8`), the bytes of the separate quantization launch."""

import pytest
import torch
from op_helpers import DTYPES, REAL, VERIFY_DTYPE, check_op, close, fused_projection, rand, sm90_report

from qwen_mtp.ops.linear import quantize_activation_rows_triton, quantize_activations_reference
from qwen_mtp.ops.norm import (
    add_rms_norm_reference,
    gated_rms_norm_reference,
    norm_triton,
    norm_w8a8_reference,
    rms_norm_reference,
)


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


# The norms that quantize their output for the W8A8 product they feed (`qwen_mtp::norm_w8a8`): the one-pass path
# (a 27B hidden row), the chunked one (rows over 8192 wide, `_row_block`), and the per-head gated norm (heads of
# 128, one quantization group each).
W8A8_NORM_CASES = {  # (width, heads, residual add)
    "whole row": (5120, None, False),
    "whole row, add": (5120, None, True),
    "one chunk, add": (1024, None, True),  # a 0.8B hidden row
    "chunked": (9216, None, False),
    "chunked, add": (9216, None, True),
    "gated heads": (128, 4, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(W8A8_NORM_CASES))
def test_norm_quantizing_its_output_equals_the_separate_quantization_bitwise(dtype, case):
    """The norm launch with QUANT writes the normed rows unchanged, and the very bytes and scales the W8A8
    product's own quantization launch (`quantize_activation_rows_triton`) gives them, row by row alone too."""
    width, heads, add = W8A8_NORM_CASES[case]
    shape = (3, heads, width) if heads else (3, width)
    x, delta = rand(*shape, dtype=dtype, seed=1), rand(*shape, dtype=dtype, seed=2) if add else None
    gate = rand(*shape, dtype=dtype, seed=3) if heads else None
    weight = rand(width, dtype=dtype, seed=4, scale=0.1)
    plain = norm_triton(x, weight, 1e-6, gate, delta)
    normed, *rest = norm_triton(x, weight, 1e-6, gate, delta, quantize=True)
    q, q_scale = rest[-2:]
    assert torch.equal(normed, plain[0] if add else plain)
    if add:
        assert torch.equal(rest[0], plain[1])
    product_width = width * (heads or 1)  # the gated norm's rows are heads of one product row
    want_q, want_scale = quantize_activation_rows_triton(normed.reshape(-1, product_width))
    assert torch.equal(q.reshape(want_q.shape).view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(q_scale.reshape(want_scale.shape), want_scale)
    if REAL:  # the interpreter rounds to e4m3 otherwise than torch (`test_activation_rows_quantize_alone`)
        ref_q, ref_scale = quantize_activations_reference(normed.reshape(-1, product_width))
        assert torch.equal(q.reshape(ref_q.shape).view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(q_scale.reshape(ref_scale.shape), ref_scale)
    per_row = q.view(torch.uint8).reshape(x.shape[0], -1)
    for r in range(x.shape[0]):  # a row alone: the same bytes
        one = [None if t is None else t[r : r + 1] for t in (x, gate, delta)]
        alone_q = norm_triton(one[0], weight, 1e-6, one[1], one[2], quantize=True)[-2]
        assert torch.equal(alone_q.view(torch.uint8).reshape(1, -1), per_row[r : r + 1])


@pytest.mark.parametrize("add", [False, True])
def test_a_quantizing_row_cut_over_programs_gives_the_one_programs_bytes(add):
    """The one-pass quantizing norm with its row written by several programs (`_quant_slice`; each sums the whole
    row alone) gives the one-program kernel's normed rows, residual sums, e4m3 bytes and scales."""
    x, delta = rand(2, 1280, dtype=torch.bfloat16, seed=1), rand(2, 1280, dtype=torch.bfloat16, seed=2)
    weight = rand(1280, dtype=torch.bfloat16, seed=3, scale=0.1)
    args = (x, weight, 1e-6, None, delta if add else None, True)
    whole = norm_triton(*args, slice_columns=0)
    for part in (None, 128, 256):  # the default (256 for 1280: 5 programs), then 10 and 5 programs
        sliced = norm_triton(*args, slice_columns=part)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(sliced, whole, strict=True))
    with pytest.raises(ValueError, match="slices"):
        norm_triton(*args, slice_columns=640)  # 5 groups of 128: not a power of two


def test_norm_w8a8_op_passes_opcheck_and_its_reference_is_the_norms():
    ops = torch.ops.qwen_mtp
    x, delta, w = rand(2, 3, 256), rand(2, 3, 256, seed=2), rand(256, seed=3, scale=0.1)
    heads, gate, head_w = rand(2, 3, 2, 128, seed=4), rand(2, 3, 2, 128, seed=5), rand(128, seed=6, scale=0.1)
    check_op(ops.norm_w8a8, (x, w, 1e-6))
    check_op(ops.norm_w8a8, (x, w, 1e-6, None, delta))
    check_op(ops.norm_w8a8, (heads, head_w, 1e-6, gate, None, True))
    normed, summed, q, q_scale = norm_w8a8_reference(x, w, 1e-6, delta=delta)
    want_normed, want_summed = add_rms_norm_reference(x, delta, w, 1e-6)
    assert torch.equal(normed, want_normed) and torch.equal(summed, want_summed)
    want_q, want_scale = quantize_activations_reference(want_normed.reshape(-1, 256))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(q_scale, want_scale)
    assert norm_w8a8_reference(x, w, 1e-6)[1].numel() == 0  # no residual add, no sum


def test_norm_quantizing_rows_not_of_whole_groups_is_an_error():
    with pytest.raises(ValueError, match="multiple of 128"):
        norm_triton(rand(2, 200), rand(200), 1e-6, quantize=True)


def test_quantizing_norm_swiglu_and_output_gate_kernels_compile_for_hopper():
    """The kernels with QUANT compiled for the H200: each converts to e4m3 (`cvt.rn.satfinite.e4m3x2`)."""
    found = sm90_report("quantizing")
    assert set(found) == {"norm one pass, add", "norm sliced, add", "norm chunked", "norm gated heads", "swiglu",
                          "output gate"}  # fmt: skip
    assert all(count >= 1 for count in found.values()), found
