"""The FP8 block linear (`qwen_mtp::linear_fp8`): its W8A16 kernels equal the bf16 kernels on the dequantized
weight bit for bit (so a row's result never depends on M either), its reference is transformers' dequantization
followed by the plain product, and the prefill helpers equal their references."""

import pytest
import torch
import torch.nn.functional as F
from op_helpers import DEVICE, REAL, rand

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import (
    GemmPlan,
    dequantize_triton,
    dequantize_weight,
    invariant_matmul_triton,
    linear_fp8,
    linear_fp8_reference,
    quantize_activations_reference,
    quantize_activations_triton,
)
from qwen_mtp.quant.fp8 import kernel_exact_scales, quantize_fp8_block

# Under the interpreter: activations in fp32 / fp16 (its bf16 and fp8 downcasts truncate, docs/development.md).
DTYPES = [torch.bfloat16] if REAL else [torch.float32, torch.float16]
# Two block rows and three block columns, both partial: tiles of every plan straddle no block but cover edges.
N_TEST, K_TEST = (3584, 1024) if REAL else (136, 272)
ROW_COUNTS = (1, 2, 16, 17, 33)  # tile edges of 16 rows, groups of 2 and 3 tiles


def fp8_weight(n, k, seed=1):
    """A bf16 weight quantized as Qwen's releases are (bf16-valued scales: the W8A16 kernel's exact case)."""
    q, scale = quantize_fp8_block(rand(n, k, dtype=torch.bfloat16, seed=seed).cpu())
    assert kernel_exact_scales(scale)
    return q.to(DEVICE), scale.to(DEVICE)


# One plan of each family and variant (tiny tiles), with one K split and with three; the 256-column tiles span
# two block columns each (the kernel's other scale path).
PLANS = {
    "grid 16-row tiles-splits3": GemmPlan(16, 64, 2),
    "grid 256-column tiles": GemmPlan(16, 256, 1),
    "stream 3 x 16-row tiles-splits3": GemmPlan(16, 64, 2, family="stream", row_tiles=3),
    "stream 2 x 64-row tiles": GemmPlan(32, 32, 9, family="stream", block_m=64, row_tiles=2),
    "stream swapped 2 x 16 rows-splits3": GemmPlan(16, 64, 2, family="stream", row_tiles=2, swap_ab=True),
    "stream 256 cols swapped": GemmPlan(32, 256, 1, family="stream", row_tiles=2, swap_ab=True),
}


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_w8a16_equals_the_bf16_kernel_on_the_dequantized_weight_at_every_m(plan):
    dtype = DTYPES[0]
    weight, scale = fp8_weight(N_TEST, K_TEST)
    x = rand(40, K_TEST, dtype=dtype, seed=2)
    full = invariant_matmul_triton(x, weight, plan, scale=scale)
    assert torch.equal(full, invariant_matmul_triton(x, dequantize_weight(weight, scale, dtype), plan))
    for m in ROW_COUNTS:
        assert torch.equal(invariant_matmul_triton(x[:m], weight, plan, scale=scale), full[:m]), f"M={m}"
    assert torch.equal(invariant_matmul_triton(x[37:38], weight, plan, scale=scale), full[37:38])
    if plan.splits(K_TEST) > 1:  # the last split of each tile re-armed its counter for the next launch
        assert not linear._COUNTERS[x.device].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_default_plan_matches_the_reference(dtype):
    weight, scale = fp8_weight(40, 300)
    x = rand(19, 300, dtype=dtype, seed=3)
    ours = invariant_matmul_triton(x, weight, scale=scale)
    reference = linear_fp8_reference(x, weight, scale, True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 accumulation in another order, rounded to dtype
    torch.testing.assert_close(ours.float(), reference.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("invariant", [True, False])
def test_linear_fp8_reference_is_dequantize_then_linear(invariant):
    """On CPU the op is transformers' dequantization, `(fp8.float() * scale).to(dtype)`, then `qwen_mtp::linear`."""
    weight, scale = (t.cpu() for t in fp8_weight(200, 130))
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :130]
    for dtype in (torch.float32, torch.bfloat16):
        dense = (weight.float() * expanded).to(dtype)
        x = torch.randn(2, 5, 130, generator=torch.Generator().manual_seed(4)).to(dtype)
        got = linear_fp8(x, weight, scale, invariant)
        assert torch.equal(got, linear.linear(x, dense, invariant))
        if not invariant:
            assert torch.equal(got, F.linear(x, dense))


@pytest.mark.parametrize("w8a8", [True, False])
@pytest.mark.parametrize("invariant", [True, False])
def test_linear_fp8_passes_opcheck(invariant, w8a8):
    weight, scale = fp8_weight(5, 8)
    args = (rand(2, 3, 16)[..., :8], weight, scale, invariant, w8a8)
    # test_schema would multiply the e4m3 weight, which torch does not implement on CPU
    torch.library.opcheck(torch.ops.qwen_mtp.linear_fp8, args, test_utils=("test_faketensor",))
    assert torch.ops.qwen_mtp.linear_fp8(*args).is_contiguous()


def test_linear_fp8_gradient_is_the_dequantized_weights():
    weight, scale = (t.cpu() for t in fp8_weight(24, 40))
    x = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 24, dtype=torch.float64)
    linear_fp8(x, weight, scale).backward(grad)
    assert torch.equal(x.grad, grad @ dequantize_weight(weight, scale, torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_kernel_equals_the_reference(dtype):
    weight, scale = fp8_weight(200, 300)
    assert torch.equal(dequantize_triton(weight, scale, dtype), dequantize_weight(weight, scale, dtype))


@pytest.mark.parametrize("m", [1, 5, 20])
def test_activation_quantization_kernel_equals_the_reference(m):
    """Per 1x128 group: scale amax/448, M padded to a multiple of 4 with zero rows, scales M-major as cuBLASLt
    wants. The e4m3 values are compared on the GPU only: the interpreter's fp32 -> e4m3 rounding is wrong
    (it rounds halves up and drops the carry into the exponent)."""
    x = rand(m, 256, dtype=DTYPES[0], seed=5, scale=3.0)
    q, scale = quantize_activations_triton(x)
    rows = -(-m // 4) * 4
    ref_q, ref_scale = quantize_activations_reference(x, rows)
    assert q.shape == (rows, 256) and scale.shape == (rows, 2) and scale.stride() == (1, rows)
    assert torch.equal(scale, ref_scale)
    assert not q[m:].float().any()
    if REAL:
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    else:  # within the interpreter's rounding error of one e4m3 step (a factor 2 where the carry is lost)
        dequantized = q.float() * scale.repeat_interleave(128, 1)
        torch.testing.assert_close(dequantized[:m], x.float(), rtol=0.55, atol=1e-3)


def test_gemm_rejects_a_scale_of_the_wrong_grid():
    weight, scale = fp8_weight(40, 300)
    with pytest.raises(AssertionError, match="scale grid"):
        invariant_matmul_triton(rand(2, 300), weight, scale=scale[:, :2].contiguous())


def _kernel_bf16_dequantization(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `triton_helpers.FP8_TO_BF16_SCALED` computes, in torch: the e4m3 byte sign-extended to 16 bits,
    shifted left by 4 and masked to 0x87F0 is read as a bf16, then multiplied by the bf16 factor scale * 2^120
    with one round to nearest (`fma.rn.bf16x2` with -0; here an exact fp32 product rounded once)."""
    bits = (codes.view(torch.int8).to(torch.int16) << 4) & 0x87F0 - 0x10000  # 0x87F0 as an int16
    factor = (scale.float() * 2.0**120).to(torch.bfloat16)
    return (bits.view(torch.bfloat16).float() * factor.float()).to(torch.bfloat16)


def test_bf16_dequantization_bits_equal_transformers_for_every_e4m3_value():
    """The compiled bf16 path dequantizes without conversion instructions (integer ops and one bf16 multiply per
    weight); for every e4m3 code (subnormals, both zeros, +-448) and bf16 scales across the range the model can
    hold (2^-40 .. 2^8, random mantissas), the result equals `(fp8.float() * scale).to(bf16)` bit for bit."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]
    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-40, 8, (400,), generator=g).float()
    scales = (torch.rand(400, generator=g) + 1).mul(2.0**exponents).to(torch.bfloat16).float()
    scales = torch.cat([scales, torch.tensor([1.0, 2.0**-40, 255.0, 1e-4, 3e-3]).to(torch.bfloat16).float()])
    w, s = codes[None, :].expand(len(scales), -1), scales[:, None]
    expected = (w.float() * s).to(torch.bfloat16)
    got = _kernel_bf16_dequantization(w, s)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_kernel_exact_scales():
    """bf16-valued scales below 2^8 are the kernel's exact case; quantizing a bf16 weight gives them."""
    weight = rand(300, 200, dtype=torch.bfloat16, seed=6).cpu()
    assert kernel_exact_scales(quantize_fp8_block(weight)[1])
    assert not kernel_exact_scales(torch.tensor([[1.0 + 2.0**-12]]))
    assert not kernel_exact_scales(torch.tensor([[256.0]]))
