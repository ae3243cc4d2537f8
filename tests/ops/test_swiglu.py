"""SwiGLU over the fused gate/up projection (`qwen_mtp::swiglu`): equal to its reference."""

import pytest
import torch
from op_helpers import DTYPES, check_op, close, rand

from qwen_mtp.ops.swiglu import swiglu_reference, swiglu_triton


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_reference(dtype):
    gate_up = rand(2, 3, 2 * 40, dtype=dtype, seed=1)
    ours = swiglu_triton(gate_up)
    assert ours.shape == (2, 3, 40)
    close(ours, swiglu_reference(gate_up), dtype)


def test_swiglu_passes_opcheck():
    check_op(torch.ops.qwen_mtp.swiglu, (rand(2, 3, 16, dtype=torch.float32),))
    check_op(torch.ops.qwen_mtp.swiglu, (rand(2, 3, 16, dtype=torch.float32), True))  # decode path
