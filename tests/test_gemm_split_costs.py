"""`benchmarks/gemm_split_costs.py`'s kernel under the interpreter: its `last` reduction is a GEMM (the engine's K
split points, partials added in split order, counters re-armed for the next launch), and its two variants give the
same bits. `none` is not a GEMM, and `shared` waits for sibling programs, which the interpreter runs one after
another: GPU only."""

import pytest
import torch
from helpers import benchmark_module


@pytest.fixture(scope="module")
def split_costs():
    return benchmark_module("gemm_split_costs")


@pytest.mark.parametrize("m", [1, 20, 70])
def test_the_last_split_adds_every_partial_and_rearms_its_counter(split_costs, m):
    torch.manual_seed(m)
    x, w = torch.randn(m, 384), torch.randn(200, 384)
    counters = torch.zeros(64, dtype=torch.int32)
    out = split_costs.launch(x, w, (64, 64, 64, 4, 2), 128, False, counters, reduce=1)  # 3 splits of 128 columns
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
    assert not counters.any()
    for variant in ("last, loads at once", "last, own from registers"):
        code = split_costs.REDUCTIONS[variant]
        assert torch.equal(split_costs.launch(x, w, (64, 64, 64, 4, 2), 128, False, counters, reduce=code), out)
        assert not counters.any()
