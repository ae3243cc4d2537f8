"""`qwen_mtp::prefetch_weight` (ops/weight_prefetch.py): what it asks L2 for, that a compiled step keeps it and runs
it right after the projection it follows (it returns nothing, so a compiler would otherwise drop or move it), that
it launches nothing off a graph capture, and its kernel as compiled for the H200: bulk L2 prefetches after the
grid dependency wait, no load or store."""

import re

import torch
from op_helpers import sm90_report
from torch._inductor.utils import run_and_get_code

from qwen_mtp.ops import linear, weight_prefetch
from qwen_mtp.ops.linear import decode_split_columns
from qwen_mtp.ops.norm import rms_norm
from qwen_mtp.ops.weight_prefetch import prefetch_columns, prefetch_weight, window_prefetch_columns

MIB = 2**20


def test_a_weight_within_the_budget_is_asked_for_whole():
    fp8 = torch.empty(5120, 6144, dtype=torch.float8_e4m3fn)  # 27B o_proj in FP8: 30 MiB, 3 K splits of 2048
    assert decode_split_columns(fp8) == 2048
    assert prefetch_columns(fp8, 2048, 32 * MIB) == 2048


def test_a_larger_weight_gets_the_same_leading_share_of_every_split():
    bf16 = torch.empty(5120, 6144, dtype=torch.bfloat16)  # 60 MiB
    columns = prefetch_columns(bf16, 2048, 32 * MIB)
    assert columns % 8 == 0 and 1000 < columns < 1100  # 16-byte multiples: 8 bf16 columns
    assert 5120 * 3 * columns * 2 <= 32 * MIB < 5120 * 3 * (columns + 8) * 2


def test_nothing_is_asked_where_the_bulk_prefetch_cannot_take_the_rows():
    assert prefetch_columns(torch.empty(64, 100, dtype=torch.bfloat16), 64, MIB) == 0  # 200-byte rows
    assert prefetch_columns(torch.empty(256, 64, dtype=torch.bfloat16).t(), 64, MIB) == 0  # columns not contiguous
    assert prefetch_columns(torch.empty(64, 256, dtype=torch.bfloat16), 64, 0) == 0  # no budget
    assert prefetch_columns(torch.empty(64, 256, dtype=torch.bfloat16), 64, MIB) == 64


def test_no_launch_outside_a_cuda_graph_capture():
    weight, after = torch.empty(64, 256), torch.empty(1, 1, 32)
    assert window_prefetch_columns(weight, after, 128) == 0
    prefetch_weight(weight, after, 128)  # the op on CPU: nothing, no error


def test_a_compiled_step_keeps_the_op_right_after_the_projection_it_follows():
    def step(x, w_in, w_out, norm_weight):
        y = linear.linear(x, w_in, True)
        prefetch_weight(w_out, y, 32)
        h = rms_norm(y * 2.0, norm_weight, 1e-6)
        return linear.linear(rms_norm(h, norm_weight, 1e-6), w_out, True)

    x, w_in, w_out, norm_weight = torch.randn(1, 1, 32), torch.randn(64, 32), torch.randn(32, 64), torch.ones(64)
    compiled = torch.compile(step, fullgraph=True)
    out, codes = run_and_get_code(compiled, x, w_in, w_out, norm_weight)
    torch.testing.assert_close(out, step(x, w_in, w_out, norm_weight))
    code = "\n".join(codes)
    calls = [re.match(r"\s*(\w+ = )?torch\.ops\.qwen_mtp\.(\w+)\.default\(", line) for line in code.splitlines()]
    names = [call.group(2) for call in calls if call]  # the generated code's op calls, in launch order
    assert "prefetch_weight" in names, code  # kept although it returns nothing
    assert names.index("prefetch_weight") == names.index("linear") + 1, names  # right after its `after`
    assert names.index("prefetch_weight") < names.index("rms_norm"), names


def test_the_kernel_compiled_for_hopper_prefetches_after_the_wait_and_touches_nothing():
    found = sm90_report("weightprefetch")
    assert found["waits"] == 1 and found["prefetches"] >= 1 and found["prefetches_before_wait"] == 0, found
    assert found["loads"] == 0 and found["stores"] == 0, found


def test_the_default_budget_and_rows():
    assert weight_prefetch.WINDOW_PREFETCH_MIB >= 0 and weight_prefetch.WINDOW_PREFETCH_ROWS >= 1
