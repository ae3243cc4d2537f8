"""The batch-invariant GEMM (`qwen_mtp::linear` with `invariant=True`): equal to a plain product, and a row's
result never depends on the other rows or on how many there are, in every kernel family and variant."""

import dataclasses

import pytest
import torch
from op_helpers import DEVICE, DTYPES, REAL, VERIFY_DTYPE, check_op, rand

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import GemmPlan, invariant_matmul_triton, prefill_gemm_plan, prefill_rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "k,plan,splits",
    [
        (200, GemmPlan(16, 128, 1), 2),
        (300, GemmPlan(16, 128, 1), 3),  # the last split is shorter
        (300, GemmPlan(32, 64, 2, num_stages=4), 3),
        (300, GemmPlan(16, 128, 3), 1),
        (300, None, None),  # the default plan for this shape
    ],
)
def test_invariant_matmul_matches_and_is_batch_invariant(dtype, k, plan, splits):
    weight, x = rand(40, k, dtype=dtype, seed=1), rand(19, k, dtype=dtype, seed=2)
    if plan is not None:
        assert plan.splits(k) == splits
    full = invariant_matmul_triton(x, weight, plan)
    torch.testing.assert_close(
        full.float(), x.float() @ weight.float().T, rtol=2e-3, atol=2e-2 if dtype == torch.float16 else 1e-4
    )
    for i in range(0, 19, 3):
        assert torch.equal(invariant_matmul_triton(x[i : i + 1], weight, plan), full[i : i + 1])
    if splits and splits > 1:  # the last split of each tile re-armed its counter for the next launch
        assert not linear._COUNTERS[x.device].any()


def test_gemm_rows_invariant_real_shapes():
    n, k = (3584, 1024) if REAL else (48, 64)
    weight, x = rand(n, k, dtype=VERIFY_DTYPE, seed=1), rand(40, k, dtype=VERIFY_DTYPE, seed=2)
    full = invariant_matmul_triton(x, weight)
    for rows in (slice(0, 1), slice(3, 11), slice(5, 21)):
        assert torch.equal(invariant_matmul_triton(x[rows], weight), full[rows])


# One plan of each kernel variant the GPU sweep (benchmarks/gemm_family.py) times, at tiny tiles. On CPU N = 24
# and K = 144 leave partial tiles in both (masked loads) and several K blocks per split (a K order that changed
# with M would show); each variant runs with one K split and with three.
VARIANTS = {
    "grid 16-row tiles": GemmPlan(16, 32, 3),
    "grid 64-row tiles": GemmPlan(16, 32, 3, family="grid", block_m=64),
    "stream 64-row tile": GemmPlan(16, 32, 3, family="stream", block_m=64),
    "stream 3 x 16-row tiles": GemmPlan(16, 32, 3, family="stream", block_m=16, row_tiles=3),
    "stream 2 x 64-row tiles": GemmPlan(32, 32, 3, family="stream", block_m=64, row_tiles=2),
    "stream swapped 2 x 16 rows": GemmPlan(16, 32, 3, family="stream", block_m=16, row_tiles=2, swap_ab=True),
    "stream swapped 3 x 32 rows": GemmPlan(32, 16, 5, family="stream", block_m=32, row_tiles=3, swap_ab=True),
    "stream swapped, deep one-tile loop": GemmPlan(
        32, 16, 5, num_stages=6, family="stream", block_m=32, row_tiles=3, swap_ab=True, wide_stages=2
    ),
}
ROW_COUNTS = (1, 2, 15, 16, 17, 63, 64, 65, 130, 256)  # tile edges of 16 and 64 rows, groups of 2 and 3 tiles
N_TEST, K_TEST = (3584, 1024) if REAL else (24, 144)


def _variant_plans():
    for name, plan in VARIANTS.items():
        for splits in (1, 3):
            k_blocks = -(-K_TEST // plan.block_k)
            split_plan = dataclasses.replace(plan, k_per_split=-(-k_blocks // splits))
            if split_plan.splits(K_TEST) == splits:
                yield pytest.param(split_plan, id=f"{name}-splits{splits}")


def assert_right_and_rows_never_depend_on_m(plan: GemmPlan) -> None:
    """The plan's product is x W^T within its dtype's tolerance, a row's bytes are the same among M = 1..256 rows
    and alone, and a split plan's last split of each tile re-armed its counter for the next launch."""
    weight, x = rand(N_TEST, K_TEST, dtype=VERIFY_DTYPE, seed=1), rand(256, K_TEST, dtype=VERIFY_DTYPE, seed=2)
    full = invariant_matmul_triton(x, weight, plan)
    tol = 1e-4 if VERIFY_DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), x.float() @ weight.float().T, rtol=tol, atol=tol)
    for m in ROW_COUNTS:
        assert torch.equal(invariant_matmul_triton(x[:m], weight, plan), full[:m]), f"rows differ at M={m}"
    for i in (5, 70, 255):  # a row alone (slot 0) equals itself in slot i of 256
        assert torch.equal(invariant_matmul_triton(x[i : i + 1], weight, plan), full[i : i + 1])
    if plan.splits(K_TEST) > 1 or plan.tail_tiles:
        assert not linear._COUNTERS[x.device].any()


@pytest.mark.parametrize("plan", list(_variant_plans()))
def test_gemm_variant_matches_and_rows_never_depend_on_m(plan):
    assert_right_and_rows_never_depend_on_m(plan)


def test_pipeline_depths_never_change_a_row():
    """`num_stages` and `wide_stages` only move loads earlier: with the same tiles, every row's result is the same
    bit for bit, so a deeper plan can replace a tuned one without changing a token (on the GPU: the same wgmma
    sequence per accumulator, `test_linear_sass.py`)."""
    if REAL:  # the 27B gate_up tiles (wgmma 64x32x16, 4 row tiles) at the family sweep's "deep8" depths
        plan = GemmPlan(64, 128, 4, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True)
        deep = dataclasses.replace(plan, num_stages=8, wide_stages=4)
    else:
        plan = GemmPlan(32, 16, 3, family="stream", block_m=32, row_tiles=3, swap_ab=True)
        deep = dataclasses.replace(plan, num_stages=8, wide_stages=2)
    weight, x = rand(N_TEST, K_TEST, dtype=VERIFY_DTYPE, seed=1), rand(130, K_TEST, dtype=VERIFY_DTYPE, seed=2)
    for m in (1, 33, 65, 130):  # one, two and three live row tiles; a second row group
        assert torch.equal(invariant_matmul_triton(x[:m], weight, deep), invariant_matmul_triton(x[:m], weight, plan))


@pytest.mark.parametrize("tail_tiles", [1, 2])
def test_split_tail_matches_and_rows_never_depend_on_m(tail_tiles):
    """`tail_tiles`: the last N tiles split their K loop (the partial last tile among them): the product is right
    and a row's result still never depends on M; the tail's counters are re-armed for the next launch."""
    if REAL:  # the 27B gate_up tiles and depths, 56 N tiles: the last 8 in 4 splits of 2 K blocks
        plan = GemmPlan(64, 128, 8, 4, 8, family="stream", block_m=32, row_tiles=4, swap_ab=True, wide_stages=4)
        plan = dataclasses.replace(plan, tail_tiles=8 * tail_tiles, tail_splits=4)
    else:  # 2 N tiles (the second partial), 5 K blocks in 3 splits of 2, 2, 1
        plan = GemmPlan(16, 32, 5, family="stream", block_m=16, row_tiles=2, swap_ab=True, tail_tiles=1, tail_splits=3)
        plan = dataclasses.replace(plan, block_n=16 if tail_tiles == 1 else 8, tail_tiles=tail_tiles)
    assert plan.tail_tiles
    assert_right_and_rows_never_depend_on_m(plan)


@pytest.mark.parametrize(
    "fields",
    [
        dict(family="tiles"),
        dict(block_m=48),
        dict(row_tiles=2),
        dict(family="stream", row_tiles=9),
        dict(swap_ab=True),
        dict(wide_stages=2),
        dict(family="stream", wide_stages=-1),
        dict(tail_tiles=2, tail_splits=2),
        dict(family="stream", tail_tiles=2),
        dict(family="stream", tail_splits=4),
        dict(persistent=True),
        dict(family="tma", group_m=0),
        dict(family="tma", tma_loads=True),
    ],
)
def test_gemm_plan_rejects_what_no_kernel_runs(fields):
    with pytest.raises(ValueError, match="GemmPlan"):
        GemmPlan(16, 32, 1, **fields)


@pytest.mark.parametrize("invariant", [True, False])
def test_linear_passes_opcheck_on_a_strided_input(invariant):
    strided = rand(2, 3, 16, dtype=torch.float32)[..., :8]  # like one half of q_proj's [q | gate] chunk
    check_op(torch.ops.qwen_mtp.linear, (strided, rand(5, 8, dtype=torch.float32), invariant))


def test_prefill_plan_rows_never_depend_on_m():
    """The prefill plan (128-row tiles, one K split) a packed prefill runs: a row's result whatever M."""
    plan = prefill_gemm_plan(N_TEST, K_TEST)
    assert plan.splits(K_TEST) == 1 and plan.block_m == 128
    weight, x = rand(N_TEST, K_TEST, dtype=VERIFY_DTYPE, seed=3), rand(300, K_TEST, dtype=VERIFY_DTYPE, seed=4)
    full = invariant_matmul_triton(x, weight, plan)
    tol = 1e-4 if VERIFY_DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), x.float() @ weight.float().T, rtol=tol, atol=tol)
    for m in (1, 127, 128, 129, 256):
        assert torch.equal(invariant_matmul_triton(x[:m], weight, plan), full[:m]), f"rows differ at M={m}"
    assert torch.equal(invariant_matmul_triton(x[200:201], weight, plan), full[200:201])


@pytest.mark.parametrize("persistent", [False, True])
def test_tma_plan_rows_never_depend_on_m_and_sum_as_the_grid_plan(persistent):
    """The "tma" prefill kernel (tensor-memory-accelerator loads, grouped tile order): a row's result whatever M, and
    the same bits as the "grid" kernel with one K split (`same_sums`: the tiles and the launch order move no bit),
    for a K and an N that are not multiples of the blocks (zero-filled edges)."""
    n, k, m = 96, 328, 300
    plan = GemmPlan(64, 64, 6, 4, 3, family="tma", block_m=64, group_m=3, persistent=persistent)
    grid = GemmPlan(32, 64, 6, 4, 3, block_m=64)
    assert linear.same_sums(plan, grid, n, k) and linear.tma_supported(n, k, VERIFY_DTYPE)
    weight, x = rand(n, k, dtype=VERIFY_DTYPE, seed=5), rand(m, k, dtype=VERIFY_DTYPE, seed=6)
    full = invariant_matmul_triton(x, weight, plan)
    assert torch.equal(full, invariant_matmul_triton(x, weight, grid))
    for rows in (1, 63, 64, 65, 200):
        assert torch.equal(invariant_matmul_triton(x[:rows], weight, plan), full[:rows]), f"rows differ at M={rows}"
    odd = torch.empty(m * k + 1, dtype=VERIFY_DTYPE, device=x.device)[1:].view(m, k)  # not 16-byte aligned
    odd.copy_(x)
    assert torch.equal(invariant_matmul_triton(odd, weight, plan), full)


@pytest.mark.parametrize(
    "plan",
    [
        GemmPlan(32, 64, 3),  # grid, 4 K splits (the last one block)
        GemmPlan(64, 64, 4, family="stream", row_tiles=3),
        GemmPlan(64, 64, 4, family="stream", block_m=32, row_tiles=2, swap_ab=True),
        GemmPlan(32, 64, 10, family="stream", row_tiles=2, tail_tiles=2, tail_splits=3),  # a split tail
    ],
    ids=["grid", "stream", "stream swapped", "stream tail"],
)
def test_tma_loads_change_no_bit(plan, monkeypatch):
    """`GemmPlan.tma_loads`: the same tiles copied by the tensor memory accelerator (zeros past M, N and K; K splits
    end on BLOCK_K boundaries, so no split reads another's columns), for a K and an N not multiples of the blocks."""
    made = []
    monkeypatch.setattr(linear, "_descriptor", lambda *a, real=linear._descriptor: made.append(a) or real(*a))
    n, k = 200, 616
    weight, x = rand(n, k, dtype=VERIFY_DTYPE, seed=7), rand(70, k, dtype=VERIFY_DTYPE, seed=8)
    loads = dataclasses.replace(plan, tma_loads=True)
    full = invariant_matmul_triton(x, weight, plan)
    assert torch.equal(invariant_matmul_triton(x, weight, loads), full)
    assert made, "the tensor memory accelerator's path did not run"
    for rows in (1, 17, 33):
        assert torch.equal(invariant_matmul_triton(x[:rows], weight, loads), full[:rows]), f"rows differ at M={rows}"


def test_tma_plans_refuse_a_k_split_and_fp8():
    x, weight = rand(4, 256, dtype=VERIFY_DTYPE), rand(64, 256, dtype=VERIFY_DTYPE)
    with pytest.raises(ValueError, match="one K split"):
        invariant_matmul_triton(x, weight, GemmPlan(64, 64, 2, family="tma", block_m=64))
    assert not linear.tma_supported(64, 100, torch.bfloat16)  # rows of 200 bytes: not 16-byte aligned
    fp8 = weight.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP8"):
        scale = torch.ones(1, 2, device=x.device)
        invariant_matmul_triton(x, fp8, GemmPlan(64, 64, 4, family="tma", block_m=64), scale=scale)


def test_prefill_rows_selects_the_prefill_plans_only_inside_the_block():
    device = torch.device(DEVICE)
    assert linear._invariant_plan(256, 512, device) is None  # the decode plan
    with prefill_rows():
        assert linear._invariant_plan(256, 512, device) == prefill_gemm_plan(256, 512)
        with prefill_rows():
            pass
        assert linear._invariant_plan(256, 512, device) is not None  # an inner block leaves the outer one on
    assert linear._invariant_plan(256, 512, device) is None


def test_a_tma_prefill_plan_stands_aside_for_fp8_weights_and_older_gpus(monkeypatch):
    """Where the bf16 "tma" plan cannot run (FP8 weights; no tensor memory accelerator) a shape's prefill rows take
    the "grid" plan, which sums as the "tma" plan does; FP8 weights take the W8A8 "tma" plan where prefills run
    W8A8 (`FP8_PREFILL` "scaled_mm") and the tensor memory accelerator does, else the W8A16 "grid" plan."""
    tma = GemmPlan(256, 64, 8, 8, 3, family="tma", block_m=128)
    monkeypatch.setitem(linear.PREFILL_TUNED, (256, 512), tma)
    monkeypatch.setattr(linear, "FP8_PREFILL", "scaled_mm")
    grid = linear.grid_prefill_plan(256, 512)
    assert linear.same_sums(tma, grid, 256, 512)
    with prefill_rows():
        monkeypatch.setattr(linear, "tma_available", lambda device: True)
        assert linear._invariant_plan(256, 512, torch.device("cpu"), fp8=True) == linear.prefill_plan_w8a8(256, 512)
        assert linear._invariant_plan(256, 500, torch.device("cpu"), fp8=True) == linear.grid_prefill_plan(256, 500)
        monkeypatch.setattr(linear, "FP8_PREFILL", "w8a16")
        assert linear._invariant_plan(256, 512, torch.device("cpu"), fp8=True) == grid
        monkeypatch.setattr(linear, "FP8_PREFILL", "scaled_mm")
        monkeypatch.setattr(linear, "tma_available", lambda device: False)
        assert linear._invariant_plan(256, 512, torch.device("cpu")) == grid
        monkeypatch.setattr(linear, "tma_available", lambda device: True)
        assert linear._invariant_plan(256, 512, torch.device("cpu")) == tma


# ---- row buckets: plans picked by the launch's row count, all summing as the shape's plan does ----------------

WGMMA_BASE = GemmPlan(64, 32, 2, 4, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True)  # K split every 64


@pytest.mark.parametrize(
    "fields",
    [
        dict(block_m=128, row_tiles=1),  # the row tile: the MMA's N
        dict(block_k=16, k_per_split=4, num_stages=6),  # the K block, same split points
        dict(block_n=128, num_warps=8),  # the weight tile
        dict(swap_ab=False, block_m=64, row_tiles=1),  # unswapped 64-row wgmma
        dict(family="grid", swap_ab=False, block_m=64, row_tiles=1),
    ],
)
def test_tiles_of_wgmma_plans_never_change_the_sums(fields):
    assert linear.same_sums(WGMMA_BASE, dataclasses.replace(WGMMA_BASE, **fields), 512, 1024)


@pytest.mark.parametrize(
    "fields",
    [
        dict(k_per_split=1),  # other split points
        dict(block_k=16, k_per_split=2),  # a K block of other split points
        dict(block_n=32),  # 32 weight rows on the MMA's row side: mma.sync
        dict(num_warps=2),  # under a warpgroup: mma.sync
    ],
)
def test_split_points_and_mma_sync_change_the_sums(fields):
    assert not linear.same_sums(WGMMA_BASE, dataclasses.replace(WGMMA_BASE, **fields), 512, 1024)


def test_a_split_tail_sums_alike_over_the_same_columns_only():
    n, k = 512, 1280  # 8 tiles of 64 columns, 10 K blocks of 128
    base = GemmPlan(64, 128, 10, 4, 3, "stream", 32, 4, True, tail_tiles=2, tail_splits=5)
    wide = dataclasses.replace(base, block_n=128, num_warps=8, block_m=128, row_tiles=1)
    assert linear.same_sums(base, dataclasses.replace(wide, tail_tiles=1), n, k)  # columns 384.. both
    assert not linear.same_sums(base, wide, n, k)  # 2 tiles of 128: columns 256..
    assert not linear.same_sums(base, dataclasses.replace(base, tail_splits=2), n, k)


def test_check_row_buckets_rejects_other_sums_and_unsorted_bounds(monkeypatch):
    monkeypatch.setitem(linear.TUNED, (512, 1024), WGMMA_BASE)
    wide = dataclasses.replace(WGMMA_BASE, block_m=128, row_tiles=1)
    linear.check_row_buckets({(512, 1024): ((33, wide),)})
    with pytest.raises(ValueError, match="sums otherwise"):
        linear.check_row_buckets({(512, 1024): ((33, dataclasses.replace(wide, k_per_split=1)),)})
    with pytest.raises(ValueError, match="rise"):
        linear.check_row_buckets({(512, 1024): ((65, wide), (33, wide))})


def _bucket_table(n: int, k: int):
    """A row-bucket table for one test shape: the wgmma base plan, then three other tilings from 3, 9 and 20 rows."""
    return {
        (n, k): (
            (3, dataclasses.replace(WGMMA_BASE, block_m=16, row_tiles=1, block_k=16, k_per_split=4)),
            (9, dataclasses.replace(WGMMA_BASE, swap_ab=False, block_m=64, block_n=16, row_tiles=1)),
            (20, dataclasses.replace(WGMMA_BASE, family="grid", swap_ab=False, block_m=64, row_tiles=1)),
        )
    }


def test_row_plan_picks_the_bucket_of_the_launch(monkeypatch):
    monkeypatch.setattr(linear, "L2_PREFETCH", 0)  # the tables' plans as they are (the prefetch: the test below)
    table = _bucket_table(24, 192)
    monkeypatch.setitem(linear.TUNED, (24, 192), WGMMA_BASE)
    monkeypatch.setattr(linear, "ROW_BUCKETS", table)
    plans = [linear.row_plan(24, 192, m) for m in (1, 2, 3, 8, 9, 19, 20, 300)]
    (_, a), (_, b), (_, c) = table[24, 192]
    assert plans == [WGMMA_BASE, WGMMA_BASE, a, a, b, b, c, c]
    assert linear.row_plan(24, 192, 300, hopper=False) == WGMMA_BASE  # measured on Hopper only


@pytest.mark.skipif(REAL, reason="integer-valued inputs test the dispatch; on CUDA: the bf16 test below")
def test_bucketed_launches_are_right_at_every_row_count(monkeypatch):
    """Each bucket's kernel launch (swapped, unswapped, grid, other K block) over integer-valued inputs, exact in
    any summation order: right products and the same rows at the bucket edges. Which bits a rounding sum gives
    across tilings is the GPU's property (sum_order; checked on the H200 by gemm_buckets.py and the test below)."""
    n, k = 24, 192
    monkeypatch.setitem(linear.TUNED, (n, k), WGMMA_BASE)
    monkeypatch.setattr(linear, "ROW_BUCKETS", _bucket_table(n, k))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-3, 4, (n, k), generator=gen).float().to(DEVICE)
    x = torch.randint(-3, 4, (40, k), generator=gen).float().to(DEVICE)
    full = invariant_matmul_triton(x, weight)
    assert torch.equal(full, x @ weight.T)
    for m in (1, 2, 3, 8, 9, 19, 20, 33):
        assert torch.equal(invariant_matmul_triton(x[:m], weight), full[:m]), f"M={m}"
    assert not linear._COUNTERS[x.device].any()


@pytest.mark.skipif(not REAL, reason="the bits of rounding sums across tilings are the GPU's (sum_order)")
def test_row_buckets_rows_never_depend_on_m():
    """Every shape with row buckets: a row's bf16 result is the same at every M, across each bucket's edges."""
    if not linear.ROW_BUCKETS:
        pytest.skip("no row buckets tuned")
    for (n, k), entries in linear.ROW_BUCKETS.items():
        weight, x = rand(n, k, dtype=torch.bfloat16, seed=1), rand(300, k, dtype=torch.bfloat16, seed=2)
        full = invariant_matmul_triton(x, weight)
        edges = sorted({1, 2, 300, *(f + d for f, _ in entries for d in (-1, 0, 1))})
        for m in edges:
            assert torch.equal(invariant_matmul_triton(x[:m], weight), full[:m]), f"{n}x{k}: rows differ at M={m}"


def test_row_plan_loads_by_tma_in_the_buckets_the_table_names(monkeypatch):
    """`TMA_LOAD_BUCKETS` names row buckets per kernel (1: the shape's own plan); QWEN_MTP_TMA_LOADS=1 / 0
    (`linear.TMA_LOADS`) turns TMA loads on / off for every plan; the sums never change."""
    table = _bucket_table(24, 192)
    monkeypatch.setitem(linear.TUNED, (24, 192), WGMMA_BASE)
    monkeypatch.setattr(linear, "ROW_BUCKETS", table)
    monkeypatch.setattr(linear, "TMA_LOAD_BUCKETS", {"bf16": {(24, 192): (1, 9)}, "w8a8": {}})
    monkeypatch.setattr(linear, "TMA_LOADS", None)
    loads = [linear.row_plan(24, 192, m).tma_loads for m in (1, 2, 3, 8, 9, 19, 20, 300)]
    assert loads == [True, True, False, False, True, True, False, False]
    assert not linear.row_plan(24, 192, 1, hopper=False).tma_loads  # measured on Hopper only
    assert not linear.row_plan(24, 192, 1, True, table, loads={}).tma_loads  # another kernel's table: its own loads
    for forced in (True, False):
        monkeypatch.setattr(linear, "TMA_LOADS", forced)
        for m in (1, 9, 300):
            plan = linear.row_plan(24, 192, m)
            assert plan.tma_loads == forced and linear.same_sums(plan, WGMMA_BASE, 24, 192)


def test_tma_load_buckets_must_name_buckets_of_the_table():
    linear.check_tma_load_buckets({(24, 192): (1, 9)}, _bucket_table(24, 192))
    with pytest.raises(ValueError, match=r"row buckets \[33\] are not in its table"):
        linear.check_tma_load_buckets({(24, 192): (1, 33)}, _bucket_table(24, 192))
    with pytest.raises(ValueError, match="not in its table"):
        linear.check_tma_load_buckets({(24, 192): (9,)}, {})


def test_l2_prefetch_asks_for_aligned_blocks_of_one_split_under_pdl_only():
    """`l2_prefetch_columns`: the plan's K blocks, at most one K split and K, 16-byte multiples; nothing without
    PDL (no kernel starts early) or on a misaligned weight. TMA loads do not matter: the kernel prefetches from
    the weight's address, not its descriptor."""
    plan = dataclasses.replace(WGMMA_BASE, k_per_split=6, l2_prefetch=3)
    weight = torch.zeros(24, 192, dtype=torch.bfloat16)
    columns = 3 * plan.block_k
    asked = {"L2_PREFETCH_K": columns, "L2_PREFETCH_BYTES": 2 * columns}
    assert linear.l2_prefetch_columns(plan, weight, True) == asked
    assert linear.l2_prefetch_columns(dataclasses.replace(plan, tma_loads=True), weight, True) == asked
    split = dataclasses.replace(plan, k_per_split=1)
    assert linear.l2_prefetch_columns(split, weight, True)["L2_PREFETCH_K"] == plan.block_k
    none = {"L2_PREFETCH_K": 0, "L2_PREFETCH_BYTES": 0}
    assert linear.l2_prefetch_columns(plan, weight, False) == none
    assert linear.l2_prefetch_columns(plan, torch.zeros(24, 196, dtype=torch.bfloat16)[:, :192], True) == none
    assert linear.l2_prefetch_columns(plan, torch.zeros(24, 208, dtype=torch.bfloat16)[:, :196], True) == none
    assert linear.l2_prefetch_columns(WGMMA_BASE, weight, True) == none


@pytest.mark.parametrize("tma", [True, False])
def test_l2_prefetch_switch_sets_every_decode_plan_and_keeps_its_loads(monkeypatch, tma):
    """QWEN_MTP_L2_PREFETCH=N (`linear.L2_PREFETCH`): every plan `row_plan` answers prefetches N K blocks, loads
    its tiles as it would without the switch, and sums alike; the "tma" family (prefill) cannot prefetch."""
    monkeypatch.setattr(linear, "TMA_LOADS", tma)
    monkeypatch.setattr(linear, "L2_PREFETCH", 4)
    for m in (1, 64, 256):
        plan = linear.row_plan(34816, 5120, m)
        assert plan.l2_prefetch == 4 and plan.tma_loads == tma
        assert linear.same_sums(plan, linear.gemm_plan(34816, 5120), 34816, 5120)
    monkeypatch.setattr(linear, "L2_PREFETCH", 0)
    assert linear.row_plan(34816, 5120, 1).l2_prefetch == 0
    with pytest.raises(ValueError, match="l2_prefetch"):
        GemmPlan(64, 64, 4, 4, 3, family="tma", block_m=64, l2_prefetch=2)
    with pytest.raises(ValueError, match="l2_prefetch"):
        dataclasses.replace(WGMMA_BASE, l2_prefetch=-1)


# ---- prefill row buckets: the prefill plan picked by the launch's row count, all summing alike -----------------

PREFILL_BASE = GemmPlan(64, 64, 4, 4, 3, family="tma", block_m=64)  # 64-row tiles, the whole K of 256 in one split
PREFILL_WIDE = GemmPlan(32, 64, 4, 4, 3, family="tma", block_m=128, persistent=True)  # from 40 rows


def test_prefill_row_plan_picks_the_bucket_of_the_launch(monkeypatch):
    """Inside `prefill_rows` a launch of M rows runs its row bucket's plan where the "tma" kernel runs; FP8 weights
    and GPUs without it keep the one "grid" stand-in; outside the block, the decode plan."""
    monkeypatch.setitem(linear.PREFILL_TUNED, (64, 256), PREFILL_BASE)
    monkeypatch.setitem(linear.PREFILL_ROW_BUCKETS, (64, 256), ((40, PREFILL_WIDE),))
    monkeypatch.setattr(linear, "tma_available", lambda device: True)
    cpu = torch.device("cpu")
    with prefill_rows():
        assert [linear._invariant_plan(64, 256, cpu, m=m) for m in (1, 39, 40, 5000)] == [PREFILL_BASE] * 2 + [
            PREFILL_WIDE
        ] * 2
        assert linear._invariant_plan(64, 256, cpu, fp8=True, m=40) == linear.prefill_plan_w8a8(64, 256)
        monkeypatch.setattr(linear, "tma_available", lambda device: False)
        assert linear._invariant_plan(64, 256, cpu, fp8=True, m=40) == linear.grid_prefill_plan(64, 256)
        assert linear._invariant_plan(64, 256, cpu, m=40) == linear.grid_prefill_plan(64, 256)
    assert linear._invariant_plan(64, 256, cpu, m=40) is None


def test_prefill_row_buckets_must_sum_as_the_prefill_plan(monkeypatch):
    monkeypatch.setitem(linear.PREFILL_TUNED, (64, 256), PREFILL_BASE)
    linear.check_row_buckets({(64, 256): ((40, PREFILL_WIDE),)}, linear.prefill_gemm_plan)
    split = dataclasses.replace(PREFILL_WIDE, family="grid", persistent=False, k_per_split=2)  # K split at 128
    with pytest.raises(ValueError, match="sums otherwise"):
        linear.check_row_buckets({(64, 256): ((40, split),)}, linear.prefill_gemm_plan)


@pytest.mark.skipif(REAL, reason="integer-valued inputs test the dispatch; on CUDA: gemm_prefill.py checks the bits")
def test_prefill_bucketed_launches_are_right_at_every_row_count(monkeypatch):
    """The linear op's CUDA function inside `prefill_rows`, run by the interpreter with a bucket from 40 rows, over
    integer-valued inputs (exact in any summation order): right products, and the same rows on both sides of the
    bucket edge."""
    n, k = 64, 256
    monkeypatch.setitem(linear.PREFILL_TUNED, (n, k), PREFILL_BASE)
    monkeypatch.setitem(linear.PREFILL_ROW_BUCKETS, (n, k), ((40, PREFILL_WIDE),))
    launched = []
    tma_matmul = linear._tma_matmul
    monkeypatch.setattr(
        linear, "_tma_matmul", lambda x, w, out, plan: (launched.append(plan), tma_matmul(x, w, out, plan))
    )
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-3, 4, (n, k), generator=gen).float()
    x = torch.randint(-3, 4, (70, k), generator=gen).float()
    cuda_linear = linear.linear_op._direct["cuda"]
    with prefill_rows():
        full = cuda_linear(x, weight, True)
        assert torch.equal(full, x @ weight.T)
        for m in (1, 39, 40, 41):
            assert torch.equal(cuda_linear(x[:m], weight, True), full[:m]), f"rows differ at M={m}"
    assert launched == [PREFILL_WIDE, PREFILL_BASE, PREFILL_BASE, PREFILL_WIDE, PREFILL_WIDE]
