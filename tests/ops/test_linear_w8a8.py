"""The W8A8 decode GEMM (`model.fp8_decode: w8a8`, the CUDA default): e4m3 activations per row and 1x128 group
into fp8 MMAs whose 128-deep block products are scaled in fp32. Its kernel equals its plain-PyTorch reference (under the
interpreter, on inputs whose block sums are exact in any order), a row's bytes never depend on M, and its error
against the dequantized-weight product is the e4m3 activations'."""

import dataclasses

import pytest
import torch
from op_helpers import DEVICE, REAL, rand, sm90_report

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import (
    GemmPlan,
    check_w8a8_plan,
    dequantize_weight,
    gemm_plan_w8a8,
    linear_fp8,
    linear_fp8_reference,
    linear_fp8_w8a8_reference,
    linear_fp8_w8a8_triton,
    quantize_activation_rows_triton,
    quantize_activations_reference,
    w8a8_block_products_reference,
    w8a8_matmul_triton,
)
from qwen_mtp.quant.fp8 import quantize_fp8_block

# Two block rows (the second partial) and three block columns: K must be whole 128-column groups.
N_TEST, K_TEST = (3584, 1024) if REAL else (136, 384)

# Swapped and unswapped, one and several row tiles, one K split and three (each split one or two blocks).
PLANS = {
    "swapped 2 x 16 rows, 3 splits": GemmPlan(16, 128, 1, family="stream", row_tiles=2, swap_ab=True),
    "swapped 32 rows, 2 splits": GemmPlan(32, 128, 2, family="stream", block_m=32, swap_ab=True),
    "unswapped 3 x 16 rows": GemmPlan(32, 128, 3, family="stream", row_tiles=3),
    "unswapped 64 rows, 3 splits": GemmPlan(16, 128, 1, family="stream", block_m=64),
    "default": gemm_plan_w8a8(N_TEST, K_TEST),
}


def exact_operands(m: int, n: int, k: int, seed: int = 0):
    """e4m3 rows (integers up to 448) and weights (integers up to 64) with random power-of-two scales: every
    128-deep block sum is an integer below 2^24, exact in fp32 whatever the order of its additions (the
    interpreter's dot sums in its own order), and its scaled value is exact too (the kernel's fused
    multiply-add and the reference's multiply-then-add agree); the sums of scaled blocks still round."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-448, 449, (m, k), generator=g).float().to(torch.float8_e4m3fn)
    weight = torch.randint(-64, 65, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    assert q.float().abs().max() <= 448 and weight.float().abs().max() <= 64
    q_scale = 2.0 ** torch.randint(-12, 0, (m, k // 128), generator=g).float()
    scale = 2.0 ** torch.randint(-16, -6, (-(-n // 128), k // 128), generator=g).float()
    return q.to(DEVICE), q_scale.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE)


def fp8_weight(n, k, seed=1):
    q, scale = quantize_fp8_block(rand(n, k, dtype=torch.bfloat16, seed=seed).cpu() * k**-0.5)
    return q.to(DEVICE), scale.to(DEVICE)


@pytest.mark.skipif(REAL, reason="exact only without the MMA's reduced-precision accumulation (GPU: tests/gpu)")
@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_w8a8_kernel_equals_the_reference_in_its_k_order(plan):
    q, q_scale, weight, scale = exact_operands(37, N_TEST, K_TEST)
    got = w8a8_matmul_triton(q, q_scale, weight, scale, plan, torch.float32)
    assert torch.equal(got, w8a8_block_products_reference(q, q_scale, weight, scale, plan))


@pytest.mark.skipif(REAL, reason="exact only without the MMA's reduced-precision accumulation (GPU: tests/gpu)")
@pytest.mark.parametrize("plan", [PLANS["default"], PLANS["unswapped 3 x 16 rows"]], ids=["default", "unswapped"])
def test_w8a8_op_equals_the_reference_quantization_included(plan):
    """The whole decode product (quantization launch + GEMM) against `linear_fp8_w8a8_reference`, on rows whose
    1x128 groups each hold +-448 x 2^e and other e4m3 values times 2^e: their quantization is exact (scale 2^e),
    so the interpreter's e4m3 rounding never comes in, and the block sums are exact as in `exact_operands`."""
    q, _, weight, scale = exact_operands(37, N_TEST, K_TEST)
    g = torch.Generator().manual_seed(7)
    groups = q.float().cpu().view(37, -1, 128)
    groups[:, :, 0] = 448.0 * torch.where(torch.rand(groups.shape[:2], generator=g) < 0.5, -1.0, 1.0)
    x = (groups * 2.0 ** torch.randint(-10, 3, (*groups.shape[:2], 1), generator=g)).view(37, -1).to(DEVICE)
    got = linear_fp8_w8a8_triton(x, weight, scale, plan)
    assert torch.equal(got, linear_fp8_w8a8_reference(x, weight, scale, plan))


def _plan_rows_never_depend_on_m(plan, counts):
    weight, scale = fp8_weight(N_TEST, K_TEST)
    x = rand(70, K_TEST, dtype=torch.float32, seed=2, scale=3.0)
    full = linear_fp8_w8a8_triton(x, weight, scale, plan)
    assert linear_fp8_w8a8_triton(x[:0], weight, scale, plan).shape == (0, N_TEST)
    for m in counts:
        assert torch.equal(linear_fp8_w8a8_triton(x[:m], weight, scale, plan), full[:m]), f"M={m}"
    assert torch.equal(linear_fp8_w8a8_triton(x[45:46], weight, scale, plan), full[45:46])
    if plan.splits(K_TEST) > 1:  # the last split of each row group re-armed its counter for the next launch
        assert not linear._COUNTERS[x.device].any()


def test_w8a8_rows_never_depend_on_m_1_to_64():
    """The default plan (4 tiles of 32 rows): a row alone and among 1..64 rows gives the same bytes, the
    activation quantization included."""
    _plan_rows_never_depend_on_m(PLANS["default"], range(1, 65))


@pytest.mark.parametrize("plan", [p for name, p in PLANS.items() if name != "default"], ids=list(PLANS)[:-1])
def test_w8a8_rows_never_depend_on_m(plan):
    _plan_rows_never_depend_on_m(plan, (1, 2, 16, 17, 33, 48, 49))


def test_activation_rows_quantize_alone():
    """The decode layout of the activation quantization: scales [M, K/128] row-major equal to the reference's
    bit for bit, e4m3 bytes bitwise on the GPU (the interpreter's fp32 -> e4m3 rounding is wrong: within one of
    its steps there), and a row's bytes the same alone as among others."""
    x = rand(21, 256, dtype=torch.float32, seed=5, scale=3.0)
    q, scale = quantize_activation_rows_triton(x)
    ref_q, ref_scale = quantize_activations_reference(x)
    assert scale.shape == (21, 2) and scale.stride() == (2, 1) and torch.equal(scale, ref_scale)
    if REAL:
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    else:
        torch.testing.assert_close(q.float() * scale.repeat_interleave(128, 1), x, rtol=0.55, atol=1e-3)
    for row in (0, 7, 20):
        alone_q, alone_scale = quantize_activation_rows_triton(x[row : row + 1])
        assert torch.equal(alone_q.view(torch.uint8), q[row : row + 1].view(torch.uint8))
        assert torch.equal(alone_scale, scale[row : row + 1])


def test_w8a8_error_against_the_dequantized_weight_product():
    """The W8A8 reference (what the kernel computes) against the W8A16 reference on the same fp32 activations:
    the e4m3 activations' rounding (3 mantissa bits, relative error up to 2^-4 per value) averages to ~2.5e-2 of
    the product's norm; the fp32 block scaling adds nothing measurable."""
    weight, scale = (t.cpu() for t in fp8_weight(512, 1024))
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))
    ours = linear_fp8_w8a8_reference(x, weight, scale)
    dense = linear_fp8_reference(x, weight, scale, True)
    error = ((ours - dense).norm() / dense.norm()).item()
    assert 5e-3 < error < 4e-2, error
    # quantized activations times the dequantized weight: the same product up to fp32 rounding
    q, q_scale = quantize_activations_reference(x)
    w8a8 = (q.float() * q_scale.repeat_interleave(128, 1)) @ dequantize_weight(weight, scale, torch.float32).T
    torch.testing.assert_close(ours, w8a8, rtol=1e-5, atol=1e-5)


def test_w8a8_is_an_argument_of_the_op_and_the_cpu_op_stays_w8a16():
    """`linear_fp8(..., w8a8=True)` runs W8A8 on the CUDA decode path where K is whole 128-column groups
    (`w8a8_supported`); the CPU op is transformers' W8A16 reference either way."""
    weight, scale = fp8_weight(40, 256)
    assert linear.w8a8_supported(weight) and not linear.w8a8_supported(weight[:, :200])
    x, weight, scale = rand(3, 256).cpu(), weight.cpu(), scale.cpu()
    for w8a8 in (False, True):
        assert torch.equal(linear_fp8(x, weight, scale, True, w8a8), linear_fp8_reference(x, weight, scale, True))


def test_w8a8_plans_are_stream_plans_of_one_scale_group_deep():
    assert gemm_plan_w8a8(34816, 4096).splits(4096) == 1 and gemm_plan_w8a8(5120, 16384).splits(16384) == 4
    assert gemm_plan_w8a8(5120, 17408) == linear.TUNED_W8A8[5120, 17408]  # the H200's choice for 27B shapes
    for n, k in ((34816, 5120), (5120, 17408), (48, 1024), (16384, 5120), *linear.TUNED_W8A8):
        check_w8a8_plan(gemm_plan_w8a8(n, k))
    with pytest.raises(ValueError, match="block_k 128"):
        check_w8a8_plan(GemmPlan(64, 64, 2, family="stream"))


def test_w8a8_loop_feeds_fp8_wgmma_from_shared_memory():
    """The 27B gate_up plan compiled for sm_90 (no GPU needed): every MMA is an e4m3 x e4m3 wgmma (QGMMA) whose
    operands both come from shared memory descriptors (no register-fed A, so no weight passes through registers),
    4 per 128-deep block and row tile (1 + 2 + 3 + 4 live-tile loops), every async copy into shared memory is 16
    bytes wide, and nothing converts a weight or activation (the only conversions pack the bf16 output)."""
    plan = gemm_plan_w8a8(34816, 5120)
    fields = [34816, 5120, plan.block_n, plan.block_k, plan.k_per_split, plan.num_warps, plan.num_stages]
    fields += [plan.family, plan.block_m, plan.row_tiles, plan.swap_ab]
    report = sm90_report("w8a8", fields)
    ops, wgmma = report["ops"], report["wgmma"]
    mma = {op: count for op, count in ops.items() if "MMA" in op}
    assert mma == {f"QGMMA.64x{plan.block_m}x32.F32.E4M3.E4M3": 4 * sum(range(1, plan.row_tiles + 1))}, mma
    assert wgmma and all(args.split()[2].startswith("gdesc[") for args in wgmma), wgmma[:4]
    copies = {op for op in ops if op.startswith("LDGSTS")}
    assert copies and all(op.endswith(".128") for op in copies), copies
    conversions = {op: n for op, n in ops.items() if op.startswith(("F2F", "I2F", "HADD2.F32", "PRMT", "HMUL2"))}
    assert set(conversions) <= {"F2FP.BF16.F32.PACK_AB"}, conversions


@pytest.mark.skipif(REAL, reason="exact only without the MMA's reduced-precision accumulation (GPU: tests/gpu)")
def test_w8a8_row_buckets_pick_the_plan_from_m_and_stay_right(monkeypatch):
    """`W8A8_ROW_BUCKETS`: a launch of M rows takes its bucket's plan (other tiles, the same K splits), and each is
    the reference's product on exact operands, so rows agree across the bucket edges."""
    n, k = N_TEST, K_TEST
    base = GemmPlan(64, 128, 1, 4, 3, family="stream", block_m=32, row_tiles=2, swap_ab=True)
    buckets = {(n, k): ((5, GemmPlan(64, 128, 1, 4, 3, family="stream", block_m=64, swap_ab=True)),)}
    linear.check_row_buckets(buckets, lambda *_: base)
    monkeypatch.setitem(linear.TUNED_W8A8, (n, k), base)
    monkeypatch.setattr(linear, "W8A8_ROW_BUCKETS", buckets)
    monkeypatch.setattr(linear, "L2_PREFETCH", 0)  # the tables' plans as they are
    assert linear.row_plan(n, k, 4, True, buckets, gemm_plan_w8a8) == base
    assert linear.row_plan(n, k, 5, True, buckets, gemm_plan_w8a8) == buckets[n, k][0][1]
    q, q_scale, weight, scale = exact_operands(12, n, k)
    full = w8a8_matmul_triton(q, q_scale, weight, scale, out_dtype=torch.float32)
    assert torch.equal(full, w8a8_block_products_reference(q, q_scale, weight, scale, base))
    for m in (1, 4, 5, 12):
        assert torch.equal(w8a8_matmul_triton(q[:m], q_scale[:m], weight, scale, out_dtype=torch.float32), full[:m])


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_w8a8_tma_loads_change_no_bit(plan, monkeypatch):
    """`GemmPlan.tma_loads`: the same e4m3 blocks copied by the tensor memory accelerator (zeros past M and N)."""
    made = []
    monkeypatch.setattr(linear, "_descriptor", lambda *a, real=linear._descriptor: made.append(a) or real(*a))
    x = rand(37, K_TEST, dtype=torch.bfloat16, seed=4)
    weight, scale = fp8_weight(N_TEST, K_TEST)
    q, q_scale = quantize_activation_rows_triton(x)
    loads = dataclasses.replace(plan, tma_loads=True)
    full = w8a8_matmul_triton(q, q_scale, weight, scale, plan)
    assert torch.equal(w8a8_matmul_triton(q, q_scale, weight, scale, loads), full)
    assert made, "the tensor memory accelerator's path did not run"
    for m in (1, 16, 17):
        assert torch.equal(w8a8_matmul_triton(q[:m], q_scale[:m], weight, scale, loads), full[:m])


@pytest.mark.parametrize("m", [1, 5, 33])
def test_quantize_rows_launch_choices_change_no_bit(m):
    """Rows per program and warps (`QUANTIZE_ROWS_PLANS`, picked by M) only spread the work: every choice gives the
    same bytes and scales (the reference's on the GPU; see above for the interpreter's e4m3 rounding)."""
    x = rand(m, K_TEST, dtype=torch.bfloat16, seed=m)
    want_q, want_scale = quantize_activations_reference(x) if REAL else quantize_activation_rows_triton(x, 16, 4)
    assert linear.quantize_rows_plan(m) in {(block, warps) for _, block, warps in linear.QUANTIZE_ROWS_PLANS}
    for block_rows, warps in [(None, None), (1, 1), (4, 2), (16, 4)]:
        q, scale = quantize_activation_rows_triton(x, block_rows, warps)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


# ---- packed prefill rows: W8A8 on the "tma" kernel (`prefill_plan_w8a8`) --------------------------------------

# The default's 128 x 128 x 128 blocks exceed the interpreter's largest tensor in its dot: smaller tiles here (the
# default compiled for sm_90 below; its numbers: tests/gpu).
PREFILL_PLANS = {
    "64 x 64 tiles": GemmPlan(64, 128, K_TEST // 128, 4, 3, family="tma", block_m=64),
    "64 x 32, groups of 2, persistent": GemmPlan(32, 128, K_TEST // 128, 4, 3, "tma", 64, group_m=2, persistent=True),
}


@pytest.mark.skipif(REAL, reason="exact only without the MMA's reduced-precision accumulation (GPU: tests/gpu)")
@pytest.mark.parametrize("plan", list(PREFILL_PLANS.values()), ids=list(PREFILL_PLANS))
def test_w8a8_prefill_kernel_equals_the_reference_at_every_m(plan):
    """The "tma" kernel on e4m3 rows: the reference's one-split product in its K order, and a row's result the
    same alone, among a few rows and among many (row tiles in other programs, groups walking the N tiles)."""
    check_w8a8_plan(plan)
    q, q_scale, weight, scale = exact_operands(150, N_TEST, K_TEST)
    full = w8a8_matmul_triton(q, q_scale, weight, scale, plan, torch.float32)
    assert torch.equal(full, w8a8_block_products_reference(q, q_scale, weight, scale, plan))
    for rows in (slice(0, 1), slice(0, 37), slice(64, 65), slice(149, 150)):
        got = w8a8_matmul_triton(q[rows], q_scale[rows], weight, scale, plan, torch.float32)
        assert torch.equal(got, full[rows]), rows


@pytest.mark.skipif(REAL, reason="exact only without the MMA's reduced-precision accumulation (GPU: tests/gpu)")
def test_packed_prefill_rows_of_an_fp8_weight_run_w8a8(monkeypatch):
    """The FP8 linear op's CUDA function inside `prefill_rows` (the interpreter standing in for the H200) runs the
    W8A8 prefill plan: the W8A8 reference's product with that plan, the same rows at every M; with
    `FP8_PREFILL` "w8a16" the W8A16 kernel's product instead."""
    from qwen_mtp.ops.linear import prefill_rows

    monkeypatch.setattr(linear, "FP8_PREFILL", "scaled_mm")
    monkeypatch.setitem(linear.PREFILL_TUNED_W8A8, (N_TEST, K_TEST), PREFILL_PLANS["64 x 64 tiles"])
    q, _, weight, scale = exact_operands(70, N_TEST, K_TEST)
    g = torch.Generator().manual_seed(8)  # rows whose quantization is exact (see the test above)
    groups = q.float().cpu().view(70, -1, 128)
    groups[:, :, 0] = 448.0
    x = (groups * 2.0 ** torch.randint(-10, 3, (*groups.shape[:2], 1), generator=g)).view(70, -1).to(DEVICE)
    launched = []
    tma_matmul = linear._tma_matmul
    monkeypatch.setattr(linear, "_tma_matmul", lambda *a: (launched.append(a[3]), tma_matmul(*a)))
    cuda_fp8 = linear.linear_fp8_op._direct["cuda"]
    plan = linear.prefill_plan_w8a8(N_TEST, K_TEST)
    with prefill_rows():
        full = cuda_fp8(x, weight, scale, True, True)
        assert torch.equal(full, linear_fp8_w8a8_reference(x, weight, scale, plan))
        for m in (1, 5, 64, 65):
            assert torch.equal(cuda_fp8(x[:m], weight, scale, True, False), full[:m]), f"M={m}"
        assert launched == [plan] * 5
        monkeypatch.setattr(linear, "FP8_PREFILL", "w8a16")
        w8a16 = cuda_fp8(x, weight, scale, True, True)
    grid = linear.grid_prefill_plan(N_TEST, K_TEST)
    assert len(launched) == 5 and torch.equal(w8a16, linear.invariant_matmul_triton(x, weight, grid, scale=scale))


def test_w8a8_prefill_plan_feeds_fp8_wgmma_by_tensor_copies():
    """The default W8A8 prefill plan at the 27B gate_up shape compiled for sm_90 (no GPU needed): e4m3 x e4m3
    wgmma, blocks copied by the tensor memory accelerator, within the H200's shared memory."""
    plan = linear.prefill_plan_w8a8(34816, 5120)
    named = {field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)[3:]}
    found = sm90_report("tma", [plan.block_n, plan.block_k, plan.k_per_split, named], True)
    assert found["wgmma"] > 0 and found["mma_sync"] == 0 and found["e4m3_wgmma"] == found["wgmma"], found
    assert found["tensor_copies"] > 0 and found["shared"] <= 227 << 10, found


def test_quantize_rows_plans_rise():
    bounds = [fewest for fewest, _, _ in linear.QUANTIZE_ROWS_PLANS]
    assert bounds[0] == 1 and bounds == sorted(set(bounds))
    assert linear.quantize_rows_plan(4) == linear.QUANTIZE_ROWS_PLANS[0][1:]
    assert linear.quantize_rows_plan(256) == linear.QUANTIZE_ROWS_PLANS[-1][1:]
