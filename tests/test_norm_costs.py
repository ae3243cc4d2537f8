"""`benchmarks/norm_costs.py` under the interpreter: each of its slice widths is a cut the engine's quantizing norm
takes (a 5120-wide row), with the one-program kernel's bytes, with and without the residual add."""

import pytest
import torch
from helpers import benchmark_module


@pytest.mark.parametrize("add", [False, True])
def test_every_timed_slice_width_gives_the_one_program_bytes(add):
    norm_costs = benchmark_module("norm_costs")
    torch.manual_seed(0)
    x, delta = torch.randn(1, norm_costs.N).bfloat16(), torch.randn(1, norm_costs.N).bfloat16()
    weight = (torch.randn(norm_costs.N) * 0.1).bfloat16()
    delta = delta if add else None
    whole = norm_costs.engine_norm(x, weight, 1e-6, delta, slice_columns=0)
    for slices in norm_costs.SLICES:
        sliced = norm_costs.engine_norm(x, weight, 1e-6, delta, slice_columns=norm_costs.N // slices)
        assert norm_costs.same_bytes(sliced, whole), slices
