"""The TMA-load choice without a GPU: a `benchmarks/gemm_tma_loads.py` report -> `pick_tma_buckets` -> the
`TMA_LOAD_BUCKETS` table in ops/linear.py, per kernel, shape and row bucket."""

import ast
import shutil

import pytest
from helpers import benchmark_module

from qwen_mtp.ops import linear


@pytest.fixture(scope="module")
def tma_loads():
    return benchmark_module("gemm_tma_loads")


def _rows(kind, n, k, ratios, same_bits=True):
    return [dict(kind=kind, n=n, k=k, m=m, pointer_us=100.0, tma_us=100.0 * r, same_bits=same_bits)
            for m, r in ratios.items()]  # fmt: skip


def test_a_bucket_loads_by_tma_only_where_it_never_lost_and_won_on_average(tma_loads):
    n, k = 34816, 5120  # gate_up: row buckets from 33, 65 and 129 rows in both kernels' tables (W8A8 also from 17)
    assert [f for f, _ in linear.ROW_BUCKETS[n, k]] == [33, 65, 129]
    rows = _rows("bf16", n, k, {1: 1.02, 8: 0.90, 16: 0.90, 32: 0.90})  # lost at one row: not the shape's plan
    rows += _rows("bf16", n, k, {64: 0.96})  # won by 4%
    rows += _rows("bf16", n, k, {96: 1.00, 128: 0.95})  # 2.5% on average: not enough
    rows += _rows("bf16", n, k, {256: 0.90}, same_bits=False)  # other bits: never
    rows += _rows("w8a8", n, k, {1: 1.01, 8: 0.95, 16: 0.93, 32: 0.93, 96: 0.97, 128: 0.97})
    assert tma_loads.pick_tma_buckets(rows) == {"bf16": {(n, k): (33,)}, "w8a8": {(n, k): (1, 17, 65)}}
    assert tma_loads.pick_tma_buckets(_rows("bf16", n, k, {1: 1.0})) == {"bf16": {}, "w8a8": {}}


def test_the_table_is_written_between_its_markers_and_reads_back(tma_loads, tmp_path):
    path = tmp_path / "linear.py"
    shutil.copy(linear.__file__, path)
    source = path.read_text()
    table = {"bf16": {(34816, 5120): (129,)}, "w8a8": {(5120, 6144): (1, 65, 129)}}
    tma_loads.write_tma_buckets(table, str(path))
    text = path.read_text()
    block = text[text.index("TMA_LOAD_BUCKETS: dict") : text.index("# END TMA_LOAD_BUCKETS")]
    assert ast.literal_eval(block.split("=", 1)[1].strip()) == table
    outside = [t.split("# BEGIN TMA_LOAD_BUCKETS")[0] + t.split("# END TMA_LOAD_BUCKETS")[1] for t in (text, source)]
    assert outside[0] == outside[1]  # nothing else changed


def test_the_shipped_table_names_only_buckets_the_row_tables_have():
    linear.check_tma_load_buckets(linear.TMA_LOAD_BUCKETS["bf16"], linear.ROW_BUCKETS)
    linear.check_tma_load_buckets(linear.TMA_LOAD_BUCKETS["w8a8"], linear.W8A8_ROW_BUCKETS)
