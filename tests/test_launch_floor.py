"""`benchmarks/launch_floor.py`'s empty kernel under the interpreter: one program of the grid writes its flag, so the
launch is a real kernel of that many programs and not one the compiler could drop."""

import torch
from helpers import benchmark_module


def test_the_empty_kernel_runs_its_grid_and_writes_one_flag():
    launch_floor = benchmark_module("launch_floor")
    flags = torch.zeros(5, dtype=torch.int32)
    assert launch_floor.empty_launch(torch.empty(1, 8), flags) is flags
    assert flags.tolist() == [1, 0, 0, 0, 0]


def test_the_read_floor_sums_every_slice_whether_its_reads_wait_or_not():
    launch_floor = benchmark_module("launch_floor")
    src = torch.arange(5000, dtype=torch.int32)
    for wait in (True, False):
        out = launch_floor.read_launch(src, torch.zeros(3, dtype=torch.int32), wait)
        per_program = 2048  # one chunk a program: cdiv(cdiv(5000, 3), 2048) chunks of 2048
        expect = [int(src[i * per_program : (i + 1) * per_program].sum()) for i in range(3)]
        assert out.tolist() == expect
