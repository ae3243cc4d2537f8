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
