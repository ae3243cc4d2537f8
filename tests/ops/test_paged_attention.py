"""Decode / verify attention over the paged KV cache (`qwen_mtp::paged_attention`) and the KV write."""

import pytest
import torch
from op_helpers import (
    DEVICE,
    DTYPES,
    REAL,
    VERIFY_DTYPE,
    check_op,
    close,
    fused_projection,
    paged_setup,
    rand,
    strided_attention_step,
)

from qwen_mtp.ops import paged_attention
from qwen_mtp.ops.paged_attention import paged_attention_reference, paged_attention_triton, write_kv, write_kv_triton


@pytest.fixture(params=[False, True], ids=["unsplit", "split-kv"])
def op_kernel(request, monkeypatch):
    """The op's CUDA kernel, either choice of `SPLIT_KV` (split-KV's own tests: test_split_kv_attention.py)."""
    monkeypatch.setattr(paged_attention, "SPLIT_KV", request.param)


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_reference(length, dtype, op_kernel):
    q, kv, tables, lens = paged_setup(length, dtype)
    close(
        paged_attention_triton(q, kv, tables, lens, 32**-0.5),
        paged_attention_reference(q, kv, tables, lens, 32**-0.5),
        dtype,
    )


def test_paged_attention_verify_block_equals_decode_per_position(op_kernel):
    """Query t of a 3-token verify equals a 1-token decode at the same position, bit for bit."""
    q, kv, tables, lens = paged_setup(3, torch.float32)
    verify = paged_attention_triton(q, kv, tables, lens, 32**-0.5)
    for t in range(3):
        decode = paged_attention_triton(q[:, t : t + 1].contiguous(), kv, tables, lens - 2 + t, 32**-0.5)
        assert torch.equal(decode[:, 0], verify[:, t])
    alone = paged_attention_triton(q[1:2], kv, tables[1:2], lens[1:2], 32**-0.5)
    assert torch.equal(alone, verify[1:2])


def test_paged_attention_verify_equals_decode_real_shapes(op_kernel):
    heads, kv_heads, dim, page = (8, 2, 256, 64) if REAL else (4, 2, 32, 8)
    tables = torch.arange(24, dtype=torch.int32, device=DEVICE).reshape(8, 3)
    kv = rand(2, 24, page, kv_heads, dim, dtype=VERIFY_DTYPE, seed=1)
    lens = torch.tensor([5, 9, 3 * page, 17, 2 * page + 1, 3 * page - 1, 3, 2 * page], dtype=torch.int32, device=DEVICE)
    q = rand(8, 3, heads, dim, dtype=VERIFY_DTYPE, seed=2)
    verify = paged_attention_triton(q, kv, tables, lens, dim**-0.5)
    for t in range(3):
        decode = paged_attention_triton(q[:, t : t + 1].contiguous(), kv, tables, lens - 2 + t, dim**-0.5)
        assert torch.equal(decode[:, 0], verify[:, t]), t


def test_write_kv_kernel_equals_indexed_write():
    kv = rand(2, 12, 8, 2, 32, seed=1)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([[6, 7, 8], [0, 1, 2]], device=DEVICE)
    _, k, v = fused_projection(2, 3, [16, 64, 64], seed=2)
    k, v = k.reshape(2, 3, 2, 32), v.reshape(2, 3, 2, 32)  # strided slices
    ref, ours = kv.clone(), kv.clone()
    write_kv(k, v, ref, tables, positions)
    write_kv_triton(k, v, ours, tables, positions)
    assert torch.equal(ours, ref) and not torch.equal(ours, kv)


def test_paged_attention_passes_opcheck_with_the_models_strided_inputs():
    check_op(torch.ops.qwen_mtp.paged_attention, strided_attention_step())
