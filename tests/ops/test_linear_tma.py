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
