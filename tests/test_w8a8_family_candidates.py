"""`benchmarks/gemm_w8a8.py --family --keep-splits`: every candidate it times sums as the shape's plan does, so the
winner can replace a `TUNED_W8A8` entry while the shape's row buckets stay valid."""

import pytest
from helpers import benchmark_module

from qwen_mtp.ops.linear import TUNED_W8A8, check_w8a8_plan, gemm_plan_w8a8, same_sums


@pytest.mark.parametrize("shape", sorted(TUNED_W8A8))
def test_keep_splits_candidates_sum_as_the_shape_plan(shape):
    family = benchmark_module("gemm_w8a8")
    plans = family.w8a8_candidates(*shape, 132, keep_splits=True)
    current = gemm_plan_w8a8(*shape)
    assert len(plans) > 1 and plans["current"] == current
    for label, plan in plans.items():
        check_w8a8_plan(plan)
        assert same_sums(plan, current, *shape), label


def test_without_keep_splits_other_splits_are_timed():
    family = benchmark_module("gemm_w8a8")
    n, k = 5120, 17408
    splits = {plan.splits(k) for plan in family.w8a8_candidates(n, k, 132).values()}
    assert len(splits) > 1


@pytest.mark.parametrize("script", ["gemm_w8a8", "gemm_family"])
def test_asked_splits_are_the_splits_timed(script):
    """`--splits 3,8,16`: every variant of the sweep (W8A8 and bf16) is timed at those K split counts, where the
    wave-filling choice alone would stop at a few (mlp down: 136 K blocks of 128 columns; 256-deep blocks, 68 of
    them, cut into 16 splits of 5 give 14)."""
    module = benchmark_module(script)
    n, k = 5120, 17408
    if script == "gemm_w8a8":
        plans = module.w8a8_candidates(n, k, 132, splits_asked=(3, 8, 16))
    else:
        plans = module.candidate_plans(n, k, 132, splits_asked=(3, 8, 16))
    timed = {plan.splits(k) for label, plan in plans.items() if label != "current"}
    assert {3, 8, 16} <= timed <= {3, 8, 14, 16}
