"""`benchmarks/launch_floor.py`'s empty kernel under the interpreter: one program of the grid writes its flag, so the
launch is a real kernel of that many programs and not one the compiler could drop."""

import torch
from helpers import benchmark_module


def test_the_empty_kernel_runs_its_grid_and_writes_one_flag():
    launch_floor = benchmark_module("launch_floor")
    flags = torch.zeros(5, dtype=torch.int32)
    assert launch_floor.empty_launch(torch.empty(1, 8), flags) is flags
    assert flags.tolist() == [1, 0, 0, 0, 0]
