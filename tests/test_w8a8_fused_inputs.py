"""The W8A8 products' inputs quantized by the ops that make them (`layers.norm_for`, `GatedRMSNorm.quantized`,
`MLP`, the attention's output gate): on the decode path each norm, SwiGLU and output gate that feeds a W8A8
projection hands it its rows already quantized,
the very bytes the projection's own quantization launch would write, and nothing else changes.

On CPU every FP8 product is the W8A16 reference either way, so this checks the plumbing, with the CUDA-only
condition lifted (`w8a8_input_wanted`): which products receive a quantized input, that it is the quantization of
the input they receive, and that the tokens do not move. `tests/gpu/test_fp8.py` checks the tokens on the GPU,
where the quantized inputs are used, and `tests/ops/test_norm.py` / `test_swiglu.py` the kernels' bytes."""

import re

import torch
from helpers import random_prompt

from qwen_mtp import Engine
from qwen_mtp.model import linear as model_linear
from qwen_mtp.ops import linear as ops_linear
from qwen_mtp.ops.linear import quantize_activations_reference, w8a8_supported

PROMPTS = [random_prompt(n, seed=300 + n) for n in (1, 4, 19, 2)]


def _run(path):
    recipe = {"model": {"path": str(path), "dtype": "bfloat16", "device": "cpu"}, "mtp": {"enabled": True, "k": 2}}
    engine = Engine.from_recipe(recipe, log=lambda _: None)
    tokens = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
    return engine, tokens


def _kind(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", name)


def test_decode_path_products_take_their_inputs_quantized_by_the_producer(checkpoint, monkeypatch):
    # heads of 128: the GDN's gated norm and the attention's output gate quantize out_proj's and o_proj's inputs
    # too (a head is a whole number of groups)
    path = checkpoint("tiny-fp8", "text", dtype="bfloat16", fp8=True, linear_value_head_dim=128, head_dim=128)
    monkeypatch.setattr(model_linear.MergedLinear, "_uses_one_gemm", lambda self, x: True)  # as on CUDA
    _, want_tokens = _run(path)

    def wanted_on_any_device(x, weight, scale, w8a8):
        return scale is not None and w8a8 and w8a8_supported(weight)

    calls = []
    product = model_linear.linear_fp8

    def recording(x, weight, scale, invariant=False, w8a8=False, x_q=None, x_scale=None):
        decode = invariant and not ops_linear._PREFILL_ROWS.get()
        calls.append((weight, decode, x_q is not None))
        if x_q is not None:
            want_q, want_scale = quantize_activations_reference(x.reshape(-1, x.shape[-1]))
            assert torch.equal(x_q.reshape(want_q.shape).view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(x_scale.reshape(want_scale.shape), want_scale)
        return product(x, weight, scale, invariant, w8a8, x_q, x_scale)

    monkeypatch.setattr(model_linear, "w8a8_input_wanted", wanted_on_any_device)
    monkeypatch.setattr(model_linear, "linear_fp8", recording)
    engine, tokens = _run(path)
    assert tokens == want_tokens

    names = {id(m.weight): name for name, m in engine.model.named_modules() if hasattr(m, "fp8_decode")}
    given = {_kind(names[id(weight)]) for weight, decode, quantized in calls if quantized}
    assert all(decode for _, decode, quantized in calls if quantized)  # never on prefill rows
    assert given == {
        "model.layers.N.linear_attn.in_proj",
        "model.layers.N.linear_attn.out_proj",
        "model.layers.N.self_attn.qkv_proj",
        "model.layers.N.self_attn.o_proj",
        "model.layers.N.mlp.gate_up_proj",
        "model.layers.N.mlp.down_proj",
        "mtp.layers.N.self_attn.qkv_proj",
        "mtp.layers.N.self_attn.o_proj",
        "mtp.layers.N.mlp.gate_up_proj",
        "mtp.layers.N.mlp.down_proj",
    }
    # no decode-path product quantizes for itself (mtp.fc, whose input is two norms side by side, stays bf16 in
    # Qwen's FP8 releases)
    assert not [names[id(weight)] for weight, decode, quantized in calls if decode and not quantized]


def test_no_input_is_quantized_off_cuda(checkpoint, monkeypatch):
    """On CPU (`w8a8_input_wanted` as it is) the W8A8 input path is never taken: no product gets x_q."""
    path = checkpoint("tiny-fp8", "text", dtype="bfloat16", fp8=True)
    given = []
    product = model_linear.linear_fp8

    def recording(x, weight, scale, invariant=False, w8a8=False, x_q=None, x_scale=None):
        given.append(x_q is not None)
        return product(x, weight, scale, invariant, w8a8, x_q, x_scale)

    monkeypatch.setattr(model_linear, "linear_fp8", recording)
    _run(path)
    assert given and not any(given)
