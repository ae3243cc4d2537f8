"""The gated attention's output gate (`qwen_mtp::output_gate`): equal to its reference, reading the attention
output and the gate in place, and batch-invariant; with o_proj's W8A8 quantization (`output_gate_w8a8`), the
bytes of the separate quantization launch."""

import pytest
import torch
from op_helpers import DTYPES, REAL, check_op, close, rand

from qwen_mtp.ops.linear import quantize_activation_rows_triton, quantize_activations_reference
from qwen_mtp.ops.output_gate import output_gate_reference, output_gate_triton, output_gate_w8a8_reference


def attention_output(batch, length, heads, dim, dtype, seed=1):
    """The attention output as the layer hands it over ([B, H, T, D] transposed to [B, T, H, D]) and the gate
    (the second half of each q_proj head: [B, T, H, 2D][..., D:])."""
    out = rand(batch, heads, length, dim, dtype=dtype, seed=seed).transpose(1, 2)
    gate = rand(batch, length, heads, 2 * dim, dtype=dtype, seed=seed + 1)[..., dim:]
    return out, gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 48], ids=["power of two", "masked"])
def test_output_gate_matches_reference_in_place_and_is_batch_invariant(dtype, dim):
    out, gate = attention_output(3, 2, 4, dim, dtype)
    ours = output_gate_triton(out, gate)
    assert ours.shape == (3, 2, 4 * dim) and ours.is_contiguous()
    close(ours, output_gate_reference(out, gate, True), dtype)
    assert torch.equal(output_gate_triton(out.contiguous(), gate.contiguous()), ours)
    assert torch.equal(output_gate_triton(out[1:2], gate[1:2]), ours[1:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_gate_quantizing_equals_the_separate_quantization_bitwise(dtype):
    out, gate = attention_output(3, 2, 2, 256, dtype)
    gated, q, q_scale = output_gate_triton(out, gate, quantize=True)
    assert torch.equal(gated, output_gate_triton(out, gate))
    want_q, want_scale = quantize_activation_rows_triton(gated.reshape(6, 512))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(q_scale, want_scale)
    if REAL:  # the interpreter rounds to e4m3 otherwise than torch (`test_activation_rows_quantize_alone`)
        ref_q, ref_scale = quantize_activations_reference(gated.reshape(6, 512))
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(q_scale, ref_scale)
    _, alone_q, _ = output_gate_triton(out[2:3], gate[2:3], quantize=True)
    assert torch.equal(alone_q.view(torch.uint8), q[4:6].view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 128"):
        output_gate_triton(*attention_output(1, 1, 2, 64, dtype), quantize=True)


def test_output_gate_ops_pass_opcheck():
    out, gate = attention_output(2, 3, 2, 128, torch.float32)
    check_op(torch.ops.qwen_mtp.output_gate, (out, gate))
    check_op(torch.ops.qwen_mtp.output_gate, (out, gate, True))  # decode path
    check_op(torch.ops.qwen_mtp.output_gate_w8a8, (out, gate, True))
    gated, q, q_scale = output_gate_w8a8_reference(out, gate, True)
    assert torch.equal(gated, output_gate_reference(out, gate, True))
    want_q, want_scale = quantize_activations_reference(gated.reshape(6, 256))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(q_scale, want_scale)
