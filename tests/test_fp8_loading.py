"""FP8 block checkpoints (Qwen's `-FP8` format: e4m3 weights, bf16 `weight_scale_inv`, [128, 128] blocks) load
as FP8 and compute what Hugging Face computes when it loads the same files on CPU (it dequantizes them); bad FP8
inputs are errors naming the tensor; `model.quant: fp8-block` quantizes a BF16 checkpoint with torchao's block
quantization."""

import json
import shutil
import warnings

import pytest
import torch
from helpers import assert_greedy_matches_hf, load_hf, random_prompt
from safetensors.torch import load_file, save_file

from qwen_mtp import CheckpointError, Engine, RecipeError, load_model
from qwen_mtp.model import MergedLinear
from qwen_mtp.quant.fp8 import set_fp8_decode
from qwen_mtp.recipe import load_recipe

PROMPTS = [random_prompt(n, seed=n) for n in (1, 3, 25, 7, 40)]
ONE_GEMM = [None, True]  # per-projection products (HF's) and the CUDA layout (one GEMM per stored weight)


def fp8_checkpoint(checkpoint, layout="text", preset="tiny-fp8"):
    return checkpoint(preset, layout, dtype="bfloat16", fp8=True)


def test_fp8_checkpoint_keeps_its_fp8_tensors_as_stored(checkpoint):
    path = fp8_checkpoint(checkpoint, "vlm")
    on_disk = {
        k.replace("model.language_model.", "model."): v for k, v in load_file(path / "model.safetensors").items()
    }
    state = load_model(path, dtype=torch.bfloat16).state_dict()
    assert set(state) == set(on_disk) - {"model.visual.patch_embed.proj.weight"}
    for name, tensor in state.items():
        stored = on_disk[name]
        if name.endswith("_scale_inv"):
            assert stored.dtype == torch.bfloat16 and tensor.dtype == torch.float32  # an exact upcast
            assert torch.equal(tensor, stored.float()), name
        else:
            assert tensor.dtype == stored.dtype and torch.equal(tensor.view(torch.uint8), stored.view(torch.uint8))
    assert state["mtp.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn  # the MTP layer too
    for kept in ("mtp.fc.weight", "lm_head.weight", "model.layers.0.linear_attn.in_proj_b.weight"):
        assert state[kept].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "preset,layout,dtype",
    [("tiny-fp8", "vlm", "bfloat16"), ("tiny", "text", "float32")],  # text fp32 FP8 logits: the next test
)
def test_fp8_greedy_tokens_match_hf_loading_the_same_files(checkpoint, preset, layout, dtype):
    """ "tiny" has 64 columns and 64-row k/v projections: partial edge blocks, and a q/k/v projection whose
    segments cannot share one FP8 weight (dequantized at load with a warning): still HF's tokens."""
    path = fp8_checkpoint(checkpoint, layout, preset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine.from_recipe({"model": {"path": str(path), "dtype": dtype, "device": "cpu"}})
    uneven = [str(w.message) for w in caught if "dequantized at load" in str(w.message)]
    assert bool(uneven) == (preset == "tiny"), uneven
    results = engine.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    hf = load_hf(path, getattr(torch, dtype))
    compared = sum(assert_greedy_matches_hf(r.token_ids, hf, p, 10) for p, r in zip(PROMPTS, results, strict=True))
    # fp32: every token. bf16: those before HF's own near-ties (tests/helpers.py; this model has many: its bf16
    # logits equal HF's bit for bit, test_fp8_logits_equal_hf_bitwise), a quarter at least.
    assert compared == 10 * len(PROMPTS) if dtype == "float32" else compared >= 10 * len(PROMPTS) // 4


@pytest.mark.parametrize("one_gemm", ONE_GEMM)
def test_fp8_logits_equal_hf_bitwise(checkpoint, one_gemm):
    """Prefill logits (fp32 and bf16) equal HF's dequantized model's bit for bit, per projection; on the CUDA
    layout (one GEMM per stored weight, FP8 and bf16 segments apart) up to the fused GEMM's rounding."""
    path = fp8_checkpoint(checkpoint)
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dtype)
        model.use_one_gemm(one_gemm)
        with torch.inference_mode():
            ours, ref = model(ids), load_hf(path, dtype)(ids).logits
        if one_gemm:
            torch.testing.assert_close(ours, ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
        else:
            assert torch.equal(ours, ref)


def _generate(path, prompts, mtp):
    recipe = {"model": {"path": str(path), "dtype": "bfloat16", "device": "cpu"}, "mtp": mtp}
    engine = Engine.from_recipe(recipe, log=lambda _: None)
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=6, ignore_eos=True)]


def test_fp8_mtp_matches_plain_k1_to_4(checkpoint):
    path = fp8_checkpoint(checkpoint)
    prompts = [random_prompt(n, seed=200 + n) for n in (1, 3, 33, 5, 70, 2)]
    plain = _generate(path, prompts, {"enabled": False})
    for k in (1, 2, 3, 4):
        assert _generate(path, prompts, {"enabled": True, "k": k}) == plain, f"K={k}, batch {len(prompts)}"
    assert _generate(path, prompts[2:3], {"enabled": True, "k": 3}) == plain[2:3]  # batch 1


def _rewrite(path, tmp_path, change_tensors=None, change_config=None):
    bad = shutil.copytree(path, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    if change_tensors:
        change_tensors(tensors)
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    if change_config:
        config = json.loads((bad / "config.json").read_text())
        change_config(config["quantization_config"])
        (bad / "config.json").write_text(json.dumps(config))
    return bad


NAME = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize(
    "change_tensors,change_config,message",
    [
        (lambda t: t.pop(NAME + "_scale_inv"), None, rf"fp8 tensor {NAME} has no {NAME}_scale_inv"),
        (lambda t: t.update({NAME + "_scale_inv": torch.ones(1, 1)}), None, rf"block scale {NAME}_scale_inv has shape"),
        (lambda t: t.update({NAME: t[NAME].float()}), None, rf"tensor {NAME} has dtype torch.float32 but a block"),
        (None, lambda q: q.update(weight_block_size=[64, 64]), r"fp8 tensor .*weight_block_size \[64, 64\] is not"),
        (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}), None, "block scales without an fp8"),
    ],
    ids=["missing scale", "wrong grid", "scale on a bf16 weight", "block size", "stray scale"],
)
def test_bad_fp8_inputs_are_errors_naming_the_tensor(checkpoint, tmp_path, change_tensors, change_config, message):
    bad = _rewrite(fp8_checkpoint(checkpoint), tmp_path, change_tensors, change_config)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad)


def test_other_block_sizes_load_dequantized_on_request(checkpoint, tmp_path):
    """quant="dequantize" takes any block size: a checkpoint of 64x64 blocks loads as transformers dequantizes it."""
    from qwen_mtp.quant.fp8 import dequantize_fp8_block, quantize_fp8_block

    def reblock(tensors):
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            weight = name[: -len("_scale_inv")]
            tensors[weight], scale = quantize_fp8_block(dequantize_fp8_block(tensors[weight], tensors[name]), (64, 64))
            tensors[name] = scale.to(torch.bfloat16)

    bad = _rewrite(fp8_checkpoint(checkpoint), tmp_path, reblock, lambda q: q.update(weight_block_size=[64, 64]))
    on_disk = load_file(bad / "model.safetensors")
    state = load_model(bad, torch.float32, quant="dequantize").state_dict()
    name = "mtp.layers.0.self_attn.q_proj.weight"
    assert torch.equal(state[name], dequantize_fp8_block(on_disk[name], on_disk[name + "_scale_inv"], (64, 64)))


def test_quantize_on_load_is_torchaos_block_quantization(checkpoint):
    """`model.quant: fp8-block` on a BF16 checkpoint: each projection Qwen's releases quantize holds what torchao's
    `Float8Tensor.from_hp(w, PerBlock([128, 128]))` makes of it; the others stay bf16; MTP-on == MTP-off."""
    from torchao.quantization import Float8Tensor, PerBlock

    path = checkpoint("tiny-fp8", "text", dtype="bfloat16")
    bf16 = load_model(path, dtype=torch.bfloat16).state_dict()
    state = load_model(path, dtype=torch.bfloat16, quant="fp8-block").state_dict()
    quantized = sorted(n[: -len("_scale_inv")] for n in state if n.endswith("_scale_inv"))
    assert len(quantized) == 3 * 6 + 2 * 7  # GDN layers: qkv, z, out, gate, up, down; attention and MTP: q, k, v, o too
    for name in quantized:
        reference = Float8Tensor.from_hp(bf16[name], float8_dtype=torch.float8_e4m3fn, granularity=PerBlock([128, 128]))
        assert torch.equal(state[name].view(torch.uint8), reference.qdata.view(torch.uint8)), name
        assert torch.equal(state[name + "_scale_inv"], reference.scale), name
    for name in set(state) - set(quantized) - {n + "_scale_inv" for n in quantized}:
        assert torch.equal(state[name], bf16[name]), name  # embeddings, norms, in_proj_a/b, mtp.fc, lm_head

    def run(mtp):
        recipe = {"model": {"path": str(path), "device": "cpu", "quant": "fp8-block"}, "mtp": mtp}
        engine = Engine.from_recipe(recipe, log=lambda _: None)
        return [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)]

    assert run({"enabled": True, "k": 3}) == run({"enabled": False})


def test_fp8_decode_reaches_every_fp8_projection(checkpoint):
    """`model.fp8_decode` (default w8a8) is each FP8 projection's own choice, set by `set_fp8_decode` when the
    engine loads the model; an unknown method is an error naming the choices, in the recipe and the function."""
    path = fp8_checkpoint(checkpoint)

    def methods(model):
        return {m.fp8_decode for m in model.modules() if getattr(m, "weight_scale_inv", None) is not None}

    assert methods(load_model(path, dtype=torch.bfloat16)) == {"w8a8"}
    recipe = {"model": {"path": str(path), "device": "cpu", "fp8_decode": "w8a16"}}
    assert methods(Engine.from_recipe(recipe, log=lambda _: None).model) == {"w8a16"}
    with pytest.raises(RecipeError, match="fp8_decode"):
        load_recipe({"model": {"path": str(path), "fp8_decode": "w4a4"}})
    with pytest.raises(ValueError, match="fp8_decode must be one of"):
        set_fp8_decode(load_model(path, dtype=torch.bfloat16), "w4a4")


def test_merged_linear_with_fp8_and_bf16_segments():
    """The GDN in_proj in FP8: qkv and z in e4m3, b and a in bf16 (`unquantized_weight`). Both layouts give
    each segment's own product; state_dict round-trips; a bf16 tensor is refused by an FP8 segment."""
    gen = torch.Generator().manual_seed(0)
    segments = [("in_proj_qkv", 256), ("in_proj_z", 130), ("in_proj_b", 4), ("in_proj_a", 4)]
    merged = MergedLinear(160, segments).to(torch.bfloat16)
    with torch.no_grad():
        merged.weight.copy_(torch.randn(394, 160, generator=gen) * 0.1)
    merged.to_fp8(["in_proj_qkv", "in_proj_z"])
    assert merged.weight.shape == (386, 160) and merged.weight_scale_inv.shape == (4, 2)
    assert merged.unquantized_weight.shape == (8, 160) and merged.unquantized_weight.dtype == torch.bfloat16
    x = torch.randn(3, 5, 160, generator=gen).to(torch.bfloat16)
    per_segment = merged(x)
    merged.one_gemm = True
    torch.testing.assert_close(merged(x), per_segment, rtol=2e-2, atol=2e-2)
    assert [tuple(out.shape) for out in merged(x)] == [(3, 5, n) for _, n in segments]
    with pytest.raises(ValueError, match="cannot copy a torch.bfloat16 tensor into an FP8 weight"):
        merged.weight_loader(torch.zeros(256, 160, dtype=torch.bfloat16), "in_proj_qkv")
    with pytest.raises(ValueError, match=r"segments \['in_proj_z'\] have \[130\] rows"):
        MergedLinear(160, segments).to_fp8(["in_proj_qkv", "in_proj_z", "in_proj_b"])


def test_fp8_synthetic_presets_are_fp8_release_configs():
    from qwen_mtp.testing.synthetic import synthetic_config

    for name in ("qwen3.5-27b", "qwen3.5-9b", "qwen3.5-0.8b"):
        fp8, bf16 = synthetic_config(f"{name}-fp8"), synthetic_config(name)
        assert fp8.weight_block_size == (128, 128) and bf16.weight_block_size is None
        assert fp8.hidden_size == bf16.hidden_size and fp8.intermediate_size == bf16.intermediate_size


def test_the_tiny_fp8_fixture_is_an_fp8_checkpoint():
    from qwen_mtp.testing import fixture_path

    config = json.loads((fixture_path("tiny-fp8", dtype="bfloat16") / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
