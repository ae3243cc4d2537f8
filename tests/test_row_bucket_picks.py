"""Choosing row buckets without a GPU: `benchmarks/gemm_buckets.py`'s `pick_buckets` over a sweep's times, with
each kernel's bucket list (the W8A8 kernel's keeps a bucket from 17 rows: its 27B plans run 16-row tiles below it)."""

import dataclasses

import pytest
from helpers import benchmark_module

from qwen_mtp.ops import linear


@pytest.fixture(scope="module")
def gemm_buckets():
    return benchmark_module("gemm_buckets")


def _entry(times: dict) -> dict:
    return {"plans": {label: dict(plan=dataclasses.asdict(plan), us=us, equal=True, invariance_failures=[])
                      for label, (plan, us) in times.items()}}  # fmt: skip


def test_the_w8a8_sweep_keeps_a_32_row_bucket_from_17_rows(gemm_buckets):
    base = linear.gemm_plan_w8a8(34816, 5120)
    assert base.block_m == 16  # the 27B plan: 16-row tiles up to 16 rows
    bm32, bm64 = (dataclasses.replace(base, block_m=rows, row_tiles=1) for rows in (32, 64))
    entry = _entry({
        "now": (base, {32: 40.0, 64: 90.0, 96: 130.0, 128: 170.0, 256: 330.0}),
        "bm32": (bm32, {32: 30.0, 64: 70.0, 96: 110.0, 128: 150.0, 256: 310.0}),
        "bm64": (bm64, {32: 35.0, 64: 50.0, 96: 100.0, 128: 130.0, 256: 300.0}),
    })  # fmt: skip
    w8a8 = gemm_buckets.KINDS["w8a8"].buckets
    assert gemm_buckets.pick_buckets(entry, base, w8a8) == ((17, bm32), (33, bm64), (65, bm64), (129, bm64))
    bf16 = gemm_buckets.KINDS["bf16"].buckets
    assert gemm_buckets.pick_buckets(entry, base, bf16) == ((33, bm64), (65, bm64), (129, bm64))


def test_the_shipped_w8a8_tables_run_32_row_tiles_from_17_rows():
    """What the fourteenth session measured and shipped: per 27B FP8 shape, 16-row tiles up to 16 rows and the
    32-row plan from 17, summing alike (`check_row_buckets` at import)."""
    for (n, k), plan in linear.TUNED_W8A8.items():
        first, bucket = linear.W8A8_ROW_BUCKETS[n, k][0]
        assert (plan.block_m, first, bucket.block_m) == (16, 17, 32), (n, k)
        assert linear.same_sums(plan, bucket, n, k)
