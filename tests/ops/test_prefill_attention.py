"""Prefill attention of a prompt chunk over the paged KV cache (`qwen_mtp::paged_prefill_attention`)."""

import pytest
import torch
from op_helpers import DEVICE, DTYPES, REAL, VERIFY_DTYPE, check_op, close, rand, strided_attention_step

from qwen_mtp.ops.paged_attention import write_kv
from qwen_mtp.ops.prefill_attention import prefill_attention_reference, prefill_attention_triton


@pytest.mark.parametrize("length", [1, 7, 20])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [(128, 64, 8), (16, 16, 4)])  # (pairs per program, keys per block, warps)
def test_prefill_attention_matches_reference(length, dtype, tile):
    """A prompt chunk of `length` positions per request (the last ones of its context, some requests mid-prompt)
    over scattered pages, 3 query heads per KV head: tiles of 16 pairs cut positions' head groups apart."""
    kv = rand(2, 12, 8, 2, 32, dtype=dtype, seed=1)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 6, 0], [9, 10, 11, 4]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([length, length + 3, 29], dtype=torch.int32, device=DEVICE)
    q = rand(3, length, 6, 32, dtype=dtype, seed=2)
    k, v = rand(3, length, 2, 32, dtype=dtype, seed=3), rand(3, length, 2, 32, dtype=dtype, seed=4)
    write_kv(k, v, kv, tables, lens[:, None].long() - length + torch.arange(length, device=DEVICE))
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # the model hands q over as a transposed view
    ours = prefill_attention_triton(q_view, kv, tables, lens, 32**-0.5, *tile)
    assert ours.is_contiguous()
    close(ours, prefill_attention_reference(q, kv, tables, lens, 32**-0.5), dtype)


@pytest.mark.parametrize("context", [64, 65, 80, 100])
def test_prefill_attention_unmasked_blocks_match_reference(context):
    """A 20-position chunk at the end of a longer context, 16-key blocks: the blocks every pair of a tile sees run
    without the causal mask, then the tile's diagonal blocks with it; contexts ending on a block boundary, one
    past it and between. Two requests of different contexts in one launch."""
    page, kv_heads, dim, length = 8, 2, 32, 20
    pages = -(-(context + 7) // page)
    kv = rand(2, 2 * pages, page, kv_heads, dim, dtype=torch.float32, seed=5)
    order = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(context)).int()
    tables = order.view(2, pages).to(DEVICE)
    lens = torch.tensor([context, context + 7], dtype=torch.int32, device=DEVICE)
    q = rand(2, length, 6, dim, dtype=torch.float32, seed=6)
    ours = prefill_attention_triton(q, kv, tables, lens, dim**-0.5, 16, 16, 4)
    close(ours, prefill_attention_reference(q, kv, tables, lens, dim**-0.5), torch.float32)


def test_prefill_attention_as_accurate_as_sdpa_real_shapes():
    """A 300-token chunk at the end of a 700-token context (27B attention shapes on CUDA, bf16): the tiled
    kernel is no further from an fp32 computation than SDPA over the gathered pages (the CPU path) is."""
    heads, kv_heads, dim, page, length, context = (24, 4, 256, 64, 300, 700) if REAL else (6, 2, 32, 8, 20, 45)
    pages = -(-context // page)
    tables = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).int().to(DEVICE)[None]
    kv = rand(2, pages, page, kv_heads, dim, dtype=VERIFY_DTYPE, seed=1)
    q, lens = rand(1, length, heads, dim, dtype=VERIFY_DTYPE, seed=2), torch.tensor([context], device=DEVICE).int()
    truth = prefill_attention_reference(q.double(), kv.double(), tables, lens, dim**-0.5)
    ours = prefill_attention_triton(q, kv, tables, lens, dim**-0.5)
    sdpa = prefill_attention_reference(q, kv, tables, lens, dim**-0.5)
    ours_err, sdpa_err = ((x.double() - truth).abs().mean().item() for x in (ours, sdpa))
    assert ours_err <= 1.5 * sdpa_err + 1e-12, (ours_err, sdpa_err)


def test_prefill_attention_passes_opcheck_with_the_models_strided_inputs():
    check_op(torch.ops.qwen_mtp.paged_prefill_attention, strided_attention_step())
