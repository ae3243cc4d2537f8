"""SwiGLU over the fused gate/up projection (`qwen_mtp::swiglu`): equal to its reference; with its output's W8A8
quantization (`swiglu_w8a8`), the bytes of the separate quantization launch."""

import pytest
import torch
from op_helpers import DTYPES, REAL, check_op, close, rand

from qwen_mtp.ops.linear import quantize_activation_rows_triton, quantize_activations_reference
from qwen_mtp.ops.swiglu import swiglu_reference, swiglu_triton, swiglu_w8a8_reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_reference(dtype):
    gate_up = rand(2, 3, 2 * 40, dtype=dtype, seed=1)
    ours = swiglu_triton(gate_up)
    assert ours.shape == (2, 3, 40)
    close(ours, swiglu_reference(gate_up), dtype)


def test_swiglu_passes_opcheck():
    check_op(torch.ops.qwen_mtp.swiglu, (rand(2, 3, 16, dtype=torch.float32),))
    check_op(torch.ops.qwen_mtp.swiglu, (rand(2, 3, 16, dtype=torch.float32), True))  # decode path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [384, 1280, 3584], ids=["one block", "two blocks, the second partial", "0.8B"])
def test_swiglu_quantizing_its_output_equals_the_separate_quantization_bitwise(dtype, inter):
    """The SwiGLU launch with QUANT writes the same output, and the very bytes and scales the W8A8 down
    projection's own quantization launch (`quantize_activation_rows_triton`) gives it, a row alone too."""
    gate_up = rand(5, 2 * inter, dtype=dtype, seed=1)
    out, q, q_scale = swiglu_triton(gate_up, quantize=True)
    assert torch.equal(out, swiglu_triton(gate_up))
    want_q, want_scale = quantize_activation_rows_triton(out)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(q_scale, want_scale)
    if REAL:  # the interpreter rounds to e4m3 otherwise than torch (`test_activation_rows_quantize_alone`)
        ref_q, ref_scale = quantize_activations_reference(out)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(q_scale, ref_scale)
    _, alone_q, alone_scale = swiglu_triton(gate_up[3:4], quantize=True)
    assert torch.equal(alone_q.view(torch.uint8), q[3:4].view(torch.uint8)) and torch.equal(alone_scale, q_scale[3:4])


def test_swiglu_w8a8_op_passes_opcheck_and_its_reference_is_swiglus():
    gate_up = rand(2, 3, 512, dtype=torch.float32)
    check_op(torch.ops.qwen_mtp.swiglu_w8a8, (gate_up, True))
    out, q, q_scale = swiglu_w8a8_reference(gate_up, True)
    assert torch.equal(out, swiglu_reference(gate_up, True))
    want_q, want_scale = quantize_activations_reference(out.reshape(-1, 256))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(q_scale, want_scale)
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu_triton(rand(2, 200), quantize=True)
