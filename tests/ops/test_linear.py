"""The batch-invariant GEMM (`qwen_mtp::linear` with `invariant=True`): equal to a plain product, and a row's
result never depends on the other rows or on how many there are."""

import pytest
import torch
from op_helpers import DTYPES, REAL, VERIFY_DTYPE, check_op, rand

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import GemmPlan, invariant_matmul_triton


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


@pytest.mark.parametrize("invariant", [True, False])
def test_linear_passes_opcheck_on_a_strided_input(invariant):
    strided = rand(2, 3, 16, dtype=torch.float32)[..., :8]  # like one half of q_proj's [q | gate] chunk
    check_op(torch.ops.qwen_mtp.linear, (strided, rand(5, 8, dtype=torch.float32), invariant))
