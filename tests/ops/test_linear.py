"""The batch-invariant GEMM (`qwen_mtp::linear` with `invariant=True`): equal to a plain product, and a row's
result never depends on the other rows or on how many there are, in every kernel family and variant."""

import dataclasses

import pytest
import torch
from op_helpers import DTYPES, REAL, VERIFY_DTYPE, check_op, rand

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


def test_prefill_rows_selects_the_prefill_plans_only_inside_the_block():
    assert linear._invariant_plan(256, 512) is None  # the decode plan
    with prefill_rows():
        assert linear._invariant_plan(256, 512) == prefill_gemm_plan(256, 512)
        with prefill_rows():
            pass
        assert linear._invariant_plan(256, 512) is not None  # an inner block leaves the outer one on
    assert linear._invariant_plan(256, 512) is None
