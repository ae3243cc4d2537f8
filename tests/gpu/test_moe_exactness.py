"""On CUDA, the MoE families at their real per-layer shapes (8-layer synthetic Qwen3.5-35B-A3B and
Qwen3-Next-80B-A3B: 256 / 512 experts, top-8 / top-10, shared expert): MTP-on == MTP-off for K = 1..4 at batch
1, 8 and 32 with CUDA graphs (the fused-MoE kernels on the decode, verify and draft path), in bf16 and with FP8
block experts (the `-fp8` presets); the fused-MoE kernel's tokens never depend on the batch at those shapes, and
its FP8 form equals the bf16 kernels on the dequantized experts bit for bit."""

import gc

import pytest
import torch
from helpers import random_prompt

from qwen_mtp import Engine
from qwen_mtp.ops.linear import dequantize_weight
from qwen_mtp.ops.moe import moe_reference, moe_triton, route_reference, route_triton
from qwen_mtp.quant.fp8 import quantize_fp8_block

PRESETS = ("qwen3.5-35b-a3b-8l", "qwen3-next-80b-a3b-8l", "qwen3.5-35b-a3b-8l-fp8", "qwen3-next-80b-a3b-8l-fp8")


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """An engine's pools and graphs sit in reference cycles: collect them after each test, or the next preset's
    engines run out of the H200's memory."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def engine_for(preset, k=None, mode_graphs=True, max_batch=32):
    cache = {"max_batch": max_batch, "num_state_rows": max_batch, "num_pages": 40 * max_batch}
    recipe = {
        "model": {"synthetic": preset, "dtype": "bfloat16", "device": "cuda"},
        "cache": cache,
        "compile": {"cuda_graphs": mode_graphs},
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": "oracle", "oracle_accept": 0.7}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("preset", PRESETS)
def test_moe_mtp_equals_plain_graphs_batch_1_8_32(preset):
    vocab = 150000
    prompts = [random_prompt(n, seed=n, vocab=vocab) for n in (1, 2, 7, 130, 64, 300, 5, 33) * 4]
    plain = engine_for(preset)
    expected = {b: [r.token_ids for r in plain.generate(prompts[:b], max_new_tokens=16, ignore_eos=True)]
                for b in (1, 8, 32)}  # fmt: skip
    del plain
    gc.collect()
    for k in (1, 2, 3, 4):
        spec = engine_for(preset, k=k)
        assert spec.decode_path == "CUDA graphs"
        for batch in (1, 8, 32):
            got = [r.token_ids for r in spec.generate(prompts[:batch], max_new_tokens=16, ignore_eos=True)]
            assert got == expected[batch], f"{preset}: K={k} batch {batch} differs from plain decoding"
        del spec
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("experts,top_k", [(256, 8), (512, 10)])
def test_fused_moe_rows_invariant_real_shapes(experts, top_k):
    """A token alone, in a batch of 8 and in a verify-sized batch of 128 tokens gets the same bits; the kernel
    stays within bf16 rounding of the row-wise reference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter, tokens = 2048, 512, 128

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x = randn(tokens, hidden)
    gate_up = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    down = randn(experts, hidden, inter, scale=inter**-0.5)
    logits = randn(tokens, experts)
    weights, ids = route_triton(logits, top_k, True)
    ref_weights, ref_ids = route_reference(logits, top_k, True)
    assert (ids.sort(-1).values == ref_ids.sort(-1).values).float().mean() > 0.99  # ties aside, torch's choice
    shared, gate = randn(tokens, hidden), randn(tokens, 1)
    args = (x, gate_up, down, weights, ids, shared, gate)
    full = moe_triton(*args)
    ref = moe_reference(*args, invariant=True)
    torch.testing.assert_close(full.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for rows in (slice(0, 1), slice(77, 78), slice(8, 16), slice(120, 128)):
        part = moe_triton(x[rows], gate_up, down, weights[rows], ids[rows], shared[rows], gate[rows])
        assert torch.equal(part, full[rows]), f"tokens {rows} differ alone and in a batch of {tokens}"


def fp8_experts(weight):
    pairs = [quantize_fp8_block(expert) for expert in weight]
    return torch.stack([q for q, _ in pairs]), torch.stack([scale for _, scale in pairs])


@pytest.mark.parametrize("experts,top_k", [(256, 8), (512, 10)])
def test_fp8_fused_moe_equals_bf16_on_dequantized_experts_real_shapes(experts, top_k):
    """FP8 block experts: the same bits as the bf16 kernels on the dequantized experts (each tile dequantized in
    registers as transformers dequantizes), for a token alone and in verify-sized batches."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden, inter, tokens = 2048, 512, 128

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    gate_up, gate_up_scale = fp8_experts(randn(experts, 2 * inter, hidden, scale=hidden**-0.5))
    down, down_scale = fp8_experts(randn(experts, hidden, inter, scale=inter**-0.5))
    dense = (dequantize_weight(gate_up, gate_up_scale, torch.bfloat16),
             dequantize_weight(down, down_scale, torch.bfloat16))  # fmt: skip
    x, logits, shared, gate = randn(tokens, hidden), randn(tokens, experts), randn(tokens, hidden), randn(tokens, 1)
    weights, ids = route_triton(logits, top_k, True)
    routed = (weights, ids, shared, gate)
    full = moe_triton(x, gate_up, down, *routed, gate_up_scale, down_scale)
    assert torch.equal(full, moe_triton(x, *dense, *routed))
    ref = moe_reference(x, gate_up, down, *routed, True, gate_up_scale, down_scale)
    torch.testing.assert_close(full.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for rows in (slice(0, 1), slice(77, 78), slice(8, 16), slice(120, 128)):
        part = moe_triton(x[rows], gate_up, down, *(a[rows] for a in routed), gate_up_scale, down_scale)
        assert torch.equal(part, full[rows]), f"tokens {rows} differ alone and in a batch of {tokens}"
