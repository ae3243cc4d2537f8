"""Split-KV decode / verify attention (`split_kv_attention_triton`): equals the reference, and a position's result is
the same bit for bit in a 1-token decode and in a verify, alone and in any batch, whatever the launch spreads
its chunks over. Small chunks (32, 64 keys) on CPU so contexts cross several chunk boundaries under the
interpreter; at Qwen3.5-27B's attention shapes and the engine's plan on CUDA."""

import pytest
import torch
from op_helpers import DEVICE, DTYPES, REAL, VERIFY_DTYPE, close, rand

from qwen_mtp.ops.paged_attention import (
    SPLIT_KV_PLAN,
    SplitKvPlan,
    paged_attention_reference,
    split_kv_attention_triton,
)

# 2 blocks a chunk; 3+ chunks take 2+ merge steps; tiles of 16 pairs: a verify's 5 x 6 pairs take two, cutting
# a position's heads apart
SMALL = SplitKvPlan(split=32, block_n=16, rows=16, merge=2)
WIDE = SplitKvPlan(split=64, block_n=32)
# Chunks of 16 keys up to key 48 (three), then of 32: contexts cross the lead's end (47 / 48 / 49) and later ones
LEADING = SplitKvPlan(split=32, block_n=16, rows=16, merge=2, lead=48, lead_split=16)
# Contexts around SMALL's chunk boundaries (64 = 2 x 32: ends on one, 65: one past, 63: one short, 33 / 31) and
# WIDE's (64, 65, 63, 127), with a short and a long one.
CONTEXTS = [64, 65, 63, 33, 31, 5, 127, 48, 49]


def paged_cache(contexts, heads, kv_heads=2, dim=32, page=8, length=1, dtype=torch.float32, seed=0):
    """Queries [B, T, H, D] and a KV cache holding `contexts` on shuffled pages (each table padded to the
    longest with page 0, as the engine pads with its scratch page)."""
    widths = [-(-c // page) for c in contexts]
    width = max(widths)
    order = torch.randperm(sum(widths) + 1, generator=torch.Generator().manual_seed(seed))
    tables, used = torch.zeros(len(contexts), width, dtype=torch.int32), 0
    for b, w in enumerate(widths):
        tables[b, :w] = order[used : used + w]
        used += w
    kv = rand(2, sum(widths) + 1, page, kv_heads, dim, dtype=dtype, seed=seed + 1)
    q = rand(len(contexts), length, heads, dim, dtype=dtype, seed=seed + 2)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    return q, kv, tables.to(DEVICE), lens


@pytest.mark.parametrize("length", [1, 4])
@pytest.mark.parametrize(
    "page, group, plan", [(8, 1, SMALL), (16, 3, SMALL), (8, 6, WIDE), (16, 6, SMALL), (8, 3, LEADING)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_matches_reference(dtype, page, group, plan, length):
    q, kv, tables, lens = paged_cache(CONTEXTS, heads=2 * group, page=page, length=length, dtype=dtype)
    close(
        split_kv_attention_triton(q, kv, tables, lens, 32**-0.5, plan),
        paged_attention_reference(q, kv, tables, lens, 32**-0.5),
        dtype,
    )


@pytest.mark.parametrize("group, plan", [(1, SMALL), (3, SMALL), (6, SMALL), (3, LEADING)])
def test_split_kv_verify_row_equals_decode_at_its_position(group, plan):
    """Row t of a 5-token verify (positions straddle chunk boundaries: 60..64, 61..65, ...; with LEADING the
    lead's end too: 44..48, 45..49) equals a 1-token decode at its position, bit for bit: the property MTP-on ==
    MTP-off rests on."""
    q, kv, tables, lens = paged_cache(CONTEXTS, heads=2 * group, page=16, length=5)
    verify = split_kv_attention_triton(q, kv, tables, lens, 32**-0.5, plan)
    for t in range(5):
        decode = split_kv_attention_triton(q[:, t : t + 1], kv, tables, lens - 4 + t, 32**-0.5, plan)
        assert torch.equal(decode[:, 0], verify[:, t]), t


def test_split_kv_lead_plan_at_real_shapes_verify_equals_decode():
    """A plan with a lead (64-key chunks up to key 2048 on CUDA; 16-key ones up to key 48 on CPU), at the real
    shapes on CUDA: verify row t == a 1-token decode at its position, around the lead's end."""
    if REAL:
        heads, kv_heads, dim, page, plan = 24, 4, 256, 64, SplitKvPlan(lead=2048, lead_split=64)
        contexts = [2047, 2048, 2049, 2051, 64, 65, 3000]
    else:
        heads, kv_heads, dim, page, plan = 6, 2, 32, 8, LEADING
        contexts = [47, 48, 49, 51, 16, 17, 90]
    q, kv, tables, lens = paged_cache(contexts, heads, kv_heads, dim, page, length=4, dtype=VERIFY_DTYPE, seed=6)
    verify = split_kv_attention_triton(q, kv, tables, lens, dim**-0.5, plan)
    for t in range(4):
        decode = split_kv_attention_triton(q[:, t : t + 1], kv, tables, lens - 3 + t, dim**-0.5, plan)
        assert torch.equal(decode[:, 0], verify[:, t]), t


@pytest.mark.parametrize("length", [1, 3])
def test_split_kv_row_is_the_same_alone_and_in_any_batch(length):
    """A request's rows are the same bit for bit alone (its table only as wide as its own pages, as an eager step
    builds it: fewer chunks in the grid), in a shuffled batch, however many programs share the chunks, and with
    each block's keys loaded one iteration early (`prefetch`)."""
    q, kv, tables, lens = paged_cache(CONTEXTS, heads=6, page=8, length=length)
    plan = SplitKvPlan(split=32, block_n=16, merge=2, programs=16)
    batch = split_kv_attention_triton(q, kv, tables, lens, 32**-0.5, plan)
    for b, context in enumerate(CONTEXTS):
        table = tables[b : b + 1, : -(-context // 8)].contiguous()
        alone = split_kv_attention_triton(q[b : b + 1], kv, table, lens[b : b + 1], 32**-0.5, plan)
        assert torch.equal(alone, batch[b : b + 1]), context
    order = torch.randperm(len(CONTEXTS), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    shuffled = split_kv_attention_triton(q[order], kv, tables[order], lens[order], 32**-0.5, plan)
    assert torch.equal(shuffled, batch[order])
    for programs in (1, 1000):
        spread = SplitKvPlan(split=32, block_n=16, merge=2, programs=programs)
        assert torch.equal(split_kv_attention_triton(q, kv, tables, lens, 32**-0.5, spread), batch), programs
    early = SplitKvPlan(split=32, block_n=16, merge=2, programs=16, prefetch=True)
    assert torch.equal(split_kv_attention_triton(q, kv, tables, lens, 32**-0.5, early), batch)


def test_split_kv_real_shapes_verify_equals_decode_and_batch_equals_alone():
    """The engine's plan at Qwen3.5-27B's attention shapes on CUDA (bf16, 24 query / 4 KV heads, head dim 256,
    pages of 64); tiny shapes and chunks of 32 on CPU."""
    if REAL:
        heads, kv_heads, dim, page, plan = 24, 4, 256, 64, SPLIT_KV_PLAN
        contexts = [512, 513, 511, 1027, 2047, 5, 2100, 2049]  # around 512-key chunks (and a 2048-key lead's end)
    else:
        heads, kv_heads, dim, page, plan = 6, 2, 32, 8, SplitKvPlan(split=32, block_n=16, merge=2)
        contexts = [32, 33, 31, 68, 96, 5, 73, 8]
    q, kv, tables, lens = paged_cache(contexts, heads, kv_heads, dim, page, length=4, dtype=VERIFY_DTYPE, seed=5)
    verify = split_kv_attention_triton(q, kv, tables, lens, dim**-0.5, plan)
    reference = paged_attention_reference(q, kv, tables, lens, dim**-0.5)
    if VERIFY_DTYPE == torch.float32:
        close(verify, reference, VERIFY_DTYPE)
    else:  # bf16 outputs: another summation order lands a few values one ulp off; as accurate as the reference
        truth = paged_attention_reference(q.double(), kv.double(), tables, lens, dim**-0.5)
        ours, theirs = ((out.double() - truth).abs() for out in (verify, reference))
        assert ours.max() <= 2 * theirs.max() and ours.mean() <= 1.1 * theirs.mean(), (ours.max(), theirs.max())
    for t in range(4):
        decode = split_kv_attention_triton(q[:, t : t + 1], kv, tables, lens - 3 + t, dim**-0.5, plan)
        assert torch.equal(decode[:, 0], verify[:, t]), t
    for b in (0, 3, 6):
        alone = split_kv_attention_triton(q[b : b + 1], kv, tables[b : b + 1], lens[b : b + 1], dim**-0.5, plan)
        assert torch.equal(alone, verify[b : b + 1]), contexts[b]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_split_kv_graph_replay_follows_new_context_lengths():
    """Captured once, the kernels follow the context lengths' new values on replay (no host read of lengths)."""
    q, kv, tables, lens = paged_cache([40, 100, 70], heads=6, page=16, length=2, seed=7)
    static_lens = torch.full_like(lens, 2)
    split_kv_attention_triton(q, kv, tables, static_lens, 32**-0.5, SMALL)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_kv_attention_triton(q, kv, tables, static_lens, 32**-0.5, SMALL)
    static_lens.copy_(lens)
    graph.replay()
    assert torch.equal(out, split_kv_attention_triton(q, kv, tables, lens, 32**-0.5, SMALL))


def test_split_kv_plan_refuses_chunks_that_cut_a_block():
    with pytest.raises(ValueError, match="multiple of block_n"):
        SplitKvPlan(split=48, block_n=32)
    with pytest.raises(ValueError, match="multiple of block_n"):
        SplitKvPlan(lead=96, lead_split=48, block_n=32)
    with pytest.raises(ValueError, match="multiple of lead_split"):
        SplitKvPlan(lead=100, lead_split=64)


def test_split_kv_plan_counts_lead_chunks_then_split_ones():
    """The partials' chunk count from a table's width: 64-key chunks up to key 2048, then 512-key ones."""
    plan = SplitKvPlan(split=512, lead=2048, lead_split=64)
    assert plan.chunks(1, 64) == 1 and plan.chunks(32, 64) == 32  # 64 keys; 2048 keys
    assert plan.chunks(33, 64) == 33 and plan.chunks(512, 64) == 32 + 60  # 2112 keys; 32768 keys
    assert SplitKvPlan().chunks(512, 64) == 64  # no lead: 512-key chunks from key 0


def test_split_kv_plan_refuses_tiles_no_dot_runs():
    with pytest.raises(ValueError, match="power of two"):
        SplitKvPlan(rows=24)
