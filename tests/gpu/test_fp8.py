"""On CUDA with FP8 block weights: the W8A16 GEMMs at real shapes equal the bf16 GEMMs on the dequantized weights
bit for bit and never depend on M, the W8A8 decode GEMMs never depend on M either and are within stated
tolerances of their reference, the prefill GEMMs are within a stated tolerance of the dequantized model, and
MTP-on == MTP-off for K = 1..4 at batch 1, 8 and 32 with CUDA graphs (W8A8 and W8A16 decode), and the W8A8
inputs quantized by the norms, SwiGLU and the output gate give the tokens of the products quantizing them; packed
prefill rows' W8A8 GEMM never depends on M either."""

import pytest
import torch
from helpers import random_prompt

from qwen_mtp import Engine, load_model
from qwen_mtp.model import linear as model_linear
from qwen_mtp.ops import linear as linear_ops
from qwen_mtp.ops import norm as norm_ops
from qwen_mtp.ops.linear import (
    dequantize_weight,
    gemm_plan_fp8,
    gemm_plan_w8a8,
    invariant_matmul_triton,
    linear_fp8_w8a8_triton,
    prefill_plan_w8a8,
    prefill_rows,
    quantize_activation_rows_triton,
    quantize_activations_reference,
    scaled_mm_linear,
    scaled_mm_supported,
    w8a8_block_products_reference,
    w8a8_matmul_triton,
)
from qwen_mtp.quant.fp8 import quantize_fp8_block

SHAPES = [(34816, 5120), (5120, 17408), (16480, 5120), (5120, 6144), (6144 + 2048, 1024), (1024, 3584)]


def fp8_weight(n, k, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_fp8_block(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k**-0.5)


@pytest.mark.parametrize("n,k", SHAPES)
def test_w8a16_equals_bf16_kernel_on_dequantized_weights_and_is_invariant(n, k):
    weight, scale = fp8_weight(n, k)
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    plan = gemm_plan_fp8(n, k)
    full = invariant_matmul_triton(x, weight, plan, scale=scale)
    assert torch.equal(full, invariant_matmul_triton(x, dequantize_weight(weight, scale, torch.bfloat16), plan))
    for m in (1, 2, 8, 16, 17, 32, 64, 96, 128, 200):
        assert torch.equal(invariant_matmul_triton(x[:m], weight, scale=scale), full[:m]), f"M={m}"
    assert torch.equal(invariant_matmul_triton(x[150:151], weight, scale=scale), full[150:151])


W8A8_SHAPES = [(34816, 5120), (5120, 17408), (16384, 5120), (14336, 5120), (5120, 6144), (8192, 1024), (1024, 3584)]


@pytest.mark.parametrize("n,k", W8A8_SHAPES)  # 27B's FP8 projections; 0.8B's
def test_w8a8_rows_never_depend_on_m_and_match_the_reference(n, k):
    """W8A8 decode: a row's bytes are the same alone and among M = 1..256 rows (the activation
    quantization included, whose bytes equal the reference's), within the MMA's accumulation of the reference
    (fp32 block products in the kernel's order) and within e4m3 activations of the dequantized bf16 product."""
    weight, scale = fp8_weight(n, k)
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    full = linear_fp8_w8a8_triton(x, weight, scale)
    for m in (1, 2, 8, 16, 17, 31, 32, 33, 64, 96, 127, 128, 129, 200):
        assert torch.equal(linear_fp8_w8a8_triton(x[:m], weight, scale), full[:m]), f"M={m}"
    for row in (0, 100, 150, 255):
        assert torch.equal(linear_fp8_w8a8_triton(x[row : row + 1], weight, scale), full[row : row + 1])
    q, q_scale = quantize_activation_rows_triton(x)
    ref_q, ref_scale = quantize_activations_reference(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(q_scale, ref_scale)
    plan = gemm_plan_w8a8(n, k)
    reference = w8a8_block_products_reference(q, q_scale, weight, scale, plan)
    assert torch.equal(w8a8_matmul_triton(q, q_scale, weight, scale, plan), full)
    assert (full.float() - reference).norm() / reference.norm() < 4e-3  # bf16 output (~1.1e-3) + the MMA's sums
    dense = x.float() @ dequantize_weight(weight, scale, torch.float32).T
    assert (full.float() - dense).norm() / dense.norm() < 4e-2  # e4m3 activations: ~2.6e-2


@pytest.mark.parametrize("n,k", W8A8_SHAPES)
def test_w8a8_prefill_rows_never_depend_on_m_and_match_the_reference(n, k):
    """Packed prefill rows of an FP8 weight (`prefill_plan_w8a8`: the "tma" kernel on e4m3 rows, one K split): a
    row's bytes are the same alone and among M = 1..4096 rows, within the MMA's accumulation of the reference and
    within e4m3 activations of the dequantized bf16 product; the linear op inside `prefill_rows` runs it."""
    weight, scale = fp8_weight(n, k)
    x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    plan = prefill_plan_w8a8(n, k)
    full = linear_fp8_w8a8_triton(x, weight, scale, plan)
    for m in (1, 2, 63, 64, 127, 128, 129, 512, 1000, 2048):
        assert torch.equal(linear_fp8_w8a8_triton(x[:m], weight, scale, plan), full[:m]), f"M={m}"
    for row in (0, 1000, 4095):
        assert torch.equal(linear_fp8_w8a8_triton(x[row : row + 1], weight, scale, plan), full[row : row + 1])
    with prefill_rows(), torch.inference_mode():
        assert torch.equal(linear_ops.linear_fp8(x, weight, scale, True, True), full)
    q, q_scale = quantize_activations_reference(x[:256])
    reference = w8a8_block_products_reference(q, q_scale, weight, scale, plan)
    assert (full[:256].float() - reference).norm() / reference.norm() < 4e-3
    dense = x[:256].float() @ dequantize_weight(weight, scale, torch.float32).T
    assert (full[:256].float() - dense).norm() / dense.norm() < 4e-2


@pytest.mark.parametrize("m", [1, 5, 512, 2048])
@pytest.mark.parametrize("n,k", [(34816, 5120), (5120, 17408), (2048, 512), (512, 1024), (512, 512)])  # 27B; fixture
def test_scaled_mm_prefill_is_the_w8a8_product(n, k, m):
    """cuBLASLt's blockwise GEMM equals the W8A8 product (activations quantized per 1x128 group) to fp32
    rounding, and is within the activation quantization's error of the bf16 product."""
    weight, scale = fp8_weight(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert scaled_mm_supported(x, weight)
    out = scaled_mm_linear(x, weight, scale).float()
    q, q_scale = quantize_activations_reference(x)
    w8a8 = (q.float() * q_scale.repeat_interleave(128, 1)) @ dequantize_weight(weight, scale, torch.float32).T
    dense = x.float() @ dequantize_weight(weight, scale, torch.float32).T
    assert (out - w8a8).norm() / w8a8.norm() < 5e-3
    assert (out - dense).norm() / dense.norm() < 4e-2  # e4m3 activations: ~2.6e-2 measured (kernels.md)


# prefill method -> largest relative (Frobenius) error of the logits against the dequantized-bf16 model
PREFILL_TOLERANCE = {"dequantize": 0.0, "w8a16": 1e-2, "scaled_mm": 6e-2}


@pytest.mark.parametrize("method", sorted(PREFILL_TOLERANCE))
def test_fp8_logits_against_the_dequantized_bf16_model(checkpoint, method, monkeypatch):
    """Prefill logits of an FP8 checkpoint (hidden 512, so K = 512 and 1024 take the scaled_mm path) against the
    same checkpoint dequantized at load: "dequantize" is the same cuBLAS product (equal), "w8a16" our kernel
    (fp32 accumulation in another order), "scaled_mm" adds e4m3 activations. Greedy tokens agree almost always."""
    path = checkpoint("tiny-fp8", "text", dtype="bfloat16", fp8=True, hidden_size=512, intermediate_size=1024)
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(3)).cuda()
    monkeypatch.setattr(linear_ops, "FP8_PREFILL", method)
    with torch.inference_mode():
        ours = load_model(path, dtype=torch.bfloat16, device="cuda")(ids).float()
        ref = load_model(path, dtype=torch.bfloat16, device="cuda", quant="dequantize")(ids).float()
    error = ((ours - ref).norm() / ref.norm()).item()
    assert error <= PREFILL_TOLERANCE[method], error
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= (1.0 if method == "dequantize" else 0.95)


def engine_for(k=None, mode_graphs=True, max_batch=32, fp8_decode="w8a8"):
    cache = {"max_batch": max_batch, "num_state_rows": max_batch, "num_pages": 40 * max_batch}
    recipe = {
        "model": {"synthetic": "qwen3.5-0.8b-fp8", "dtype": "bfloat16", "device": "cuda", "fp8_decode": fp8_decode},
        "cache": cache,
        "compile": {"cuda_graphs": mode_graphs},
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": "oracle", "oracle_accept": 0.7}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("fp8_decode", ["w8a8", "w8a16"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_fp8_mtp_equals_plain_batch_1_8_32_graphs(k, fp8_decode, monkeypatch):
    """MTP-on == MTP-off at batch 1, 8 and 32 with CUDA graphs (and eager at 8), with either FP8 decode product;
    the W8A8 kernel is what the decode path ran with `fp8_decode: w8a8` (the default; every FP8 projection of the
    0.8B preset has K a multiple of 128), and never with w8a16."""
    runs = []  # the W8A8 GEMM, whoever quantized its input (the product itself or the op that made it)
    w8a8 = linear_ops.w8a8_matmul_triton
    monkeypatch.setattr(linear_ops, "w8a8_matmul_triton", lambda *args: runs.append(1) or w8a8(*args))
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (1, k + 1, 7, 130, 64, 300, 2, 33) * 4]
    plain, spec = engine_for(fp8_decode=fp8_decode), engine_for(k=k, fp8_decode=fp8_decode)
    for batch in (1, 8, 32):
        expected = [r.token_ids for r in plain.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        got = [r.token_ids for r in spec.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        assert got == expected, f"K={k} batch={batch}"
    # graphs change how a step is launched, never its numbers
    eager = engine_for(mode_graphs=False, max_batch=8, fp8_decode=fp8_decode)
    assert [r.token_ids for r in eager.generate(prompts[:8], max_new_tokens=24, ignore_eos=True)] == expected[:8]
    assert bool(runs) == (fp8_decode == "w8a8")  # captured into the engines' graphs: counted when captured


@pytest.mark.parametrize("k", [None, 3], ids=["plain", "K=3"])
def test_w8a8_inputs_quantized_by_their_producers_change_no_token(k, monkeypatch):
    """The norms, SwiGLU and the output gate quantize the W8A8 products' inputs in their own launches
    (`layers.norm_for`, one launch fewer a product): the same tokens for 32 prompts with CUDA graphs as the
    products quantizing for themselves, and the quantizing norms ran in the one and not in the other."""
    quantizing = []
    norm_triton = norm_ops.norm_triton
    monkeypatch.setattr(
        norm_ops, "norm_triton", lambda *a, **kw: quantizing.append(kw.get("quantize")) or norm_triton(*a, **kw)
    )
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (1, 5, 7, 130, 64, 300, 2, 33) * 4]
    fused = [r.token_ids for r in engine_for(k=k).generate(prompts, max_new_tokens=24, ignore_eos=True)]
    assert any(quantizing)  # the graphs are captured as the engine first meets a bucket
    monkeypatch.setattr(model_linear, "w8a8_input_wanted", lambda *args: False)
    quantizing.clear()
    separate = engine_for(k=k).generate(prompts, max_new_tokens=24, ignore_eos=True)
    errors = {repr(r.error) for r in separate if r.error is not None}  # a failed step: say what it raised
    assert not errors, errors
    assert [r.token_ids for r in separate] == fused
    assert not any(quantizing)
