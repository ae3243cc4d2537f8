"""What the H200 runs per weight in the W8A16 decode GEMM, read from its SASS compiled here (no GPU needed): the
e4m3 -> bf16 dequantization uses integer ops and one packed bf16 multiply per two weights, no conversion
instructions (Hopper runs those at a quarter of the integer rate; converting made the kernel slower than bf16)."""

import pytest
from op_helpers import sm90_report


def test_w8a16_stream_loop_has_no_per_weight_conversions():
    # the 27B gate_up tile (34816x5120, 64x128 weight blocks, swapped, 32-row column side), one row tile
    plan = [34816, 5120, 64, 128, 40, 4, 4, "stream", 32, 1, True]
    ops = sm90_report(plan)
    weights_per_thread = 64 * 128 // (4 * 32)  # one weight block per K step over 4 warps
    assert ops.get("HGMMA.64x32x16.F32.BF16", 0) >= 8  # the K step's 8 wgmma on the dequantized block
    assert ops.get("HMUL2.BF16_V2", 0) >= weights_per_thread // 2  # the scale, two weights per instruction
    conversions = {op: count for op, count in ops.items() if op.startswith(("F2FP.F16", "HADD2.F32", "I2F", "F2F."))}
    assert not conversions, conversions
    assert ops.get("F2FP.BF16.F32.PACK_AB", 0) < weights_per_thread // 2  # only the scale factors and the output


@pytest.mark.parametrize(
    "plan", [[3584, 1024, 16, 64, 2], [3584, 1024, 16, 64, 2, 4, 3, "stream", 16, 2, True]], ids=["grid", "swapped"]
)
def test_w8a16_mma_sync_operands_have_the_bf16_kernels_k_order(plan):
    """Plans below 64 MMA rows run mma.sync, whose operand layout Triton derives from the narrowest load behind
    it: traced to the e4m3 load, a thread held 4 consecutive K values (kWidth 4) where the bf16 kernel holds 2, so
    its MMAs grouped the products differently and the H200 results differed from the bf16 kernel's in the last
    bits. The dequantized tile must reach the MMAs in the bf16 kernel's layout."""
    widths = sm90_report("kwidth", plan)
    assert widths["bf16"] and set(widths["bf16"]) == {2}
    assert widths["fp8"] == widths["bf16"]
