"""`benchmarks/w8a8_costs.py`'s probe under the interpreter: its `full` launch is the engine's one-row W8A8 product
(the plan's K splits, fp32 scaling, partials added by the last split, counters re-armed), and reading the weight
from its tile-major copy gives the same bits."""

import torch
from helpers import benchmark_module

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import GemmPlan


def test_the_full_probe_is_the_engines_w8a8_product():
    w8a8_costs = benchmark_module("w8a8_costs")
    torch.manual_seed(0)
    n, k = 200, 384
    w = (torch.randn(n, k) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3) * 4e-4 + 1e-5
    q, q_scale = linear.quantize_activations_reference(torch.randn(1, k))
    plan = GemmPlan(64, 128, 1, 4, 2, "stream", 16, 1, True)  # three K splits, one 16-row tile, swapped
    counters = torch.zeros(8, dtype=torch.int32)
    out = w8a8_costs.launch(q, q_scale, w, scale, plan, counters, mode=0)
    engine = linear.w8a8_matmul_triton(q, q_scale, w, scale, plan)
    torch.testing.assert_close(out.float(), engine.float(), rtol=1e-2, atol=1e-3)
    assert not counters.any()
    w = torch.cat([w, w[:56]])  # 256 rows (two 128-row scale blocks still): whole 64-row tiles
    engine = linear.w8a8_matmul_triton(q, q_scale, w, scale, plan)
    tiled = w8a8_costs.launch(q, q_scale, w, scale, plan, counters, tiled=w8a8_costs.tile_major(w, plan))
    assert torch.equal(tiled, w8a8_costs.launch(q, q_scale, w, scale, plan, counters))  # the same blocks, re-laid
    torch.testing.assert_close(tiled.float(), engine.float(), rtol=1e-2, atol=1e-3)
