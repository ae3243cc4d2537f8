"""`benchmarks/gemm_stream_k.py`'s probe under the interpreter: every (tile, K block) unit lands in exactly one
program's run, a tile cut into 1-3 pieces is added whole, and the tiles' counters are re-armed."""

import pytest
import torch
from helpers import benchmark_module


@pytest.fixture(scope="module")
def stream_k():
    return benchmark_module("gemm_stream_k")


@pytest.mark.parametrize("units, programs", [(6, 4), (1920, 120), (1920, 132), (5440, 264)])
def test_first_program_names_the_run_holding_each_unit(stream_k, units, programs):
    starts = [p * units // programs for p in range(programs)] + [units]
    for unit in range(units):
        p = stream_k.first_program(unit, programs, units)
        assert starts[p] <= unit < starts[p + 1]


@pytest.mark.parametrize("n, k, m, programs", [(200, 384, 1, 4), (200, 384, 5, 5), (300, 512, 16, 7), (256, 256, 3, 2)])
def test_a_stream_k_launch_is_the_product(stream_k, n, k, m, programs):
    torch.manual_seed(programs)
    x, w = torch.randn(m, k), torch.randn(n, k)
    counters = torch.zeros(8, dtype=torch.int32)
    out = stream_k.launch(x, w, programs, counters, tile=(128, 16, 128, 4, 2))
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
    assert not counters.any()
