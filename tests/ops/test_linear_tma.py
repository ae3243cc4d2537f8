"""The "tma" GEMM kernel (prefill row counts) as the H200 would run it, compiled here for sm_90: its blocks are
copied by the tensor memory accelerator and multiplied by wgmma (the MMA `same_sums` assumes for every plan with
64-row MMAs), within the H200's shared memory. The numbers are `test_linear.py`'s (interpreted)."""

import dataclasses

import pytest
from op_helpers import sm90_report

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import GemmPlan

H200_SHARED = 227 << 10  # bytes of shared memory one block may use

PLANS = [
    GemmPlan(256, 64, 80, 8, 3, family="tma", block_m=128),
    GemmPlan(128, 64, 80, 8, 4, family="tma", block_m=128, persistent=True),
    *linear.PREFILL_TUNED.values(),
]


@pytest.mark.parametrize("plan", list(dict.fromkeys(p for p in PLANS if p.family == "tma")), ids=repr)
def test_tma_plan_compiles_to_tensor_copies_and_wgmma(plan):
    named = {field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)[3:]}
    found = sm90_report("tma", [plan.block_n, plan.block_k, plan.k_per_split, named])
    assert found["wgmma"] > 0 and found["mma_sync"] == 0, found
    assert found["tensor_copies"] > 0, found
    assert found["shared"] <= H200_SHARED, found


DECODE_PLANS = [  # (N, K, W8A8, plan): 27B shapes' decode plans with `tma_loads`
    (34816, 5120, False, linear.gemm_plan(34816, 5120)),  # stream, swapped 32-row tiles, a split tail
    (5120, 6144, False, linear.ROW_BUCKETS[5120, 6144][-1][1]),  # stream, 256-row tiles, 3 K splits
    (12352, 4096, False, linear.gemm_plan(12352, 4096)),  # grid, 64-row tiles
    (34816, 5120, True, linear.gemm_plan_w8a8(34816, 5120)),  # W8A8, swapped 32-row tiles
    (5120, 17408, True, linear.W8A8_ROW_BUCKETS[5120, 17408][-1][1]),  # W8A8, unswapped 128-row tiles, 3 K splits
]


@pytest.mark.parametrize("n,k,w8a8,plan", DECODE_PLANS, ids=["gate_up", "o_proj", "9b in_proj", "w8a8", "w8a8 down"])
def test_tma_loads_compile_to_tensor_copies(n, k, w8a8, plan):
    """A decode plan with `tma_loads` compiles for sm_90 into bulk tensor copies feeding the MMAs it had."""
    loads = dataclasses.replace(plan, tma_loads=True)
    named = {field.name: getattr(loads, field.name) for field in dataclasses.fields(loads)[3:]}
    found = sm90_report("tmaloads", [n, k, w8a8, loads.block_n, loads.block_k, loads.k_per_split, named])
    assert found["tensor_copies"] > 0, found
    assert (found["wgmma"] > 0) != linear.feeds_mma_sync(plan, 9), found
    assert found["shared"] <= H200_SHARED, found
