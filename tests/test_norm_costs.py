"""`benchmarks/norm_costs.py`'s spread norm under the interpreter: a row cut over several programs gives the
engine's quantizing norm's bytes (normed rows, residual sums, e4m3 values and scales), with and without the add."""

import pytest
import torch
from helpers import benchmark_module

from qwen_mtp.ops import norm


@pytest.mark.parametrize("add", [False, True])
def test_the_spread_norm_gives_the_engines_bytes(add):
    norm_costs = benchmark_module("norm_costs")
    torch.manual_seed(0)
    x, delta = torch.randn(2, 1280).bfloat16(), torch.randn(2, 1280).bfloat16()
    weight = (torch.randn(1280) * 0.1).bfloat16()
    engine = norm.norm_triton(x, weight, 1e-6, delta=delta if add else None, quantize=True)
    for slices in (5, 10):  # 256 and 128 columns a program
        spread = norm_costs.spread_norm(x, weight, 1e-6, slices, delta if add else None)
        assert norm_costs.same_bytes(spread, engine), slices
    with pytest.raises(ValueError, match="slices"):
        norm_costs.spread_norm(x, weight, 1e-6, 2)  # 640 columns: not a power of two of groups
