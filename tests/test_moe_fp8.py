"""FP8 block MoE checkpoints keep their experts in FP8 (e4m3 weights + fp32 block scales, both checkpoint layouts:
Qwen's per-expert `-FP8` tensors and Hugging Face's 3-D `FP8Experts` ones) and compute what Hugging Face computes
on the same files (it dequantizes them on CPU); MTP-on == MTP-off on them; `model.quant: fp8-block` quantizes a
bf16 MoE checkpoint's experts; the MoE `-fp8` synthetic presets are created in FP8."""

import pytest
import torch
from helpers import assert_greedy_matches_hf, load_hf, random_prompt
from safetensors.torch import load_file

from qwen_mtp import Engine, load_model
from qwen_mtp.bench import moe_expert_bytes
from qwen_mtp.quant.fp8 import dequantize_fp8_block, quantize_fp8_block

PRESET = "tiny-moe-fp8"  # hidden 128, 8 experts of intermediate 128, top-2
E4M3 = torch.float8_e4m3fn


def fp8_moe(checkpoint, experts="per_expert"):
    return checkpoint(PRESET, dtype="bfloat16", fp8=True, experts=experts)


def experts_of(model):
    return [m.mlp.experts for m in [*model.model.layers, *model.mtp.layers]]


@pytest.mark.parametrize("experts", ["per_expert", "fused"])
def test_fp8_experts_keep_the_checkpoints_e4m3_and_scales(checkpoint, experts):
    path = fp8_moe(checkpoint, experts)
    on_disk = load_file(path / "model.safetensors")
    model = load_model(path, dtype=torch.bfloat16)
    assert all(e.gate_up_proj.dtype == e.down_proj.dtype == E4M3 for e in experts_of(model))  # MTP block's too
    slots = model.checkpoint_slots() | {name: slot for name, (_, slot) in model.checkpoint_aliases().items()}
    compared = 0
    for name, tensor in on_disk.items():
        if ".experts." not in name:
            continue
        stored = slots[name].tensor()
        if name.endswith("_scale_inv"):
            assert stored.dtype == torch.float32 and torch.equal(stored, tensor.float()), name  # an exact upcast
        else:
            assert stored.dtype == E4M3 and torch.equal(stored.view(torch.uint8), tensor.view(torch.uint8)), name
        compared += 1
    assert compared == (2 * 3 * 8 if experts == "per_expert" else 2 * 2) * 5  # 4 layers + the MTP layer
    block = model.model.layers[0].mlp
    assert block.router.weight.dtype == torch.bfloat16  # the router stays as stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_moe_logits_equal_hf_and_the_dequantized_model(checkpoint, dtype):
    """Per-expert files: HF's logits bit for bit (HF dequantizes them at load); the 3-D layout (which HF's CPU
    path cannot dequantize) gives the same logits, and so does our model dequantized at load."""
    ids = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(0))  # > 2 GDN chunks
    per_expert, fused = fp8_moe(checkpoint), fp8_moe(checkpoint, "fused")
    with torch.inference_mode():
        ours = load_model(per_expert, dtype=dtype)(ids)
        assert torch.equal(ours, load_hf(per_expert, dtype)(ids).logits)
        assert torch.equal(load_model(fused, dtype=dtype)(ids), ours)
        assert torch.equal(load_model(fused, dtype=dtype, quant="dequantize")(ids), ours)


def test_fp8_moe_greedy_tokens_match_hf(checkpoint):
    path = fp8_moe(checkpoint)
    engine = Engine.from_recipe({"model": {"path": str(path), "dtype": "float32", "device": "cpu"}}, log=lambda _: None)
    assert all(e.gate_up_proj.dtype == E4M3 for e in experts_of(engine.model))
    prompts = [random_prompt(n, seed=n) for n in (1, 7, 70)]
    results = engine.generate(prompts, max_new_tokens=10, ignore_eos=True)
    hf = load_hf(path, torch.float32)
    compared = sum(assert_greedy_matches_hf(r.token_ids, hf, p, 10) for p, r in zip(prompts, results, strict=True))
    assert compared == 10 * len(prompts)


MTP_PROMPTS = [random_prompt(n, seed=300 + n) for n in (1, 5, 2, 33, 3, 40, 4, 19)]  # 1 and K+1 for every K


@pytest.mark.parametrize("k,draft", [(1, "head"), (2, "oracle"), (3, "oracle"), (4, "head")])
def test_fp8_moe_mtp_matches_plain_batch1_and_batch8(checkpoint, k, draft):
    path = fp8_moe(checkpoint, "fused")

    def engine(mtp=None):
        recipe = {"model": {"path": str(path), "dtype": "bfloat16", "device": "cpu"}, "cache": {"prefill_chunk": 32}}
        return Engine.from_recipe(recipe | ({"mtp": mtp} if mtp else {}), log=lambda _: None)

    def generate(e, prompts):
        return [r.token_ids for r in e.generate(prompts, max_new_tokens=8, ignore_eos=True)]

    off = generate(engine(), MTP_PROMPTS)
    spec = engine({"enabled": True, "k": k, "draft": draft, "oracle_accept": 0.8})
    assert all(e.down_proj.dtype == E4M3 for e in experts_of(spec.model))
    assert generate(spec, MTP_PROMPTS) == off  # batch 8
    assert [generate(spec, [p])[0] for p in MTP_PROMPTS[:2]] == off[:2]  # batch 1
    assert spec.stats()["verify_steps"] > 0


def test_quant_fp8_block_quantizes_a_bf16_moe_checkpoints_experts(checkpoint):
    """`quant="fp8-block"`: every expert is torchao's 128x128 block quantization of its bf16 values, the routers
    stay bf16, and the model computes what the bf16 model computes with every FP8 tensor dequantized."""
    path = checkpoint(PRESET, dtype="bfloat16", experts="per_expert")
    plain, fp8 = load_model(path, dtype=torch.bfloat16), load_model(path, dtype=torch.bfloat16, quant="fp8-block")
    for ours, ref in zip(experts_of(fp8), experts_of(plain), strict=True):
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_fp8_block(getattr(ref, name)[3])
            assert torch.equal(getattr(ours, name)[3].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(getattr(ours, f"{name}_scale_inv")[3], scale)
    assert fp8.model.layers[0].mlp.router.weight.dtype == torch.bfloat16
    assert fp8.model.layers[0].mlp.shared_expert.down_proj.weight.dtype == E4M3
    slots, ref_slots = fp8.checkpoint_slots(), plain.checkpoint_slots()
    dequantized = 0
    for name, slot in slots.items():  # the reference: each FP8 tensor (experts, shared expert, ...) dequantized
        scale = slots.get(name + "_scale_inv")
        if scale is not None:
            ref_slots[name].load(dequantize_fp8_block(slot.tensor(), scale.tensor()).to(torch.bfloat16))
            dequantized += ".experts." in name
    assert dequantized == 2 * 5
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(fp8(ids), plain(ids))


def test_moe_fp8_synthetic_presets(monkeypatch):
    """The `-fp8` MoE presets are FP8 release configs of the bf16 shapes (and valid recipes); a synthetic FP8 MoE
    is created with e4m3 experts and bf16 routers, and the bench counts its experts' bytes as stored."""
    from qwen_mtp.recipe import load_recipe
    from qwen_mtp.testing import synthetic

    for name in ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b-8l", "qwen3-next-80b-a3b-8l"):
        fp8, bf16 = synthetic.synthetic_config(f"{name}-fp8"), synthetic.synthetic_config(name)
        assert fp8.weight_block_size == (128, 128) and bf16.weight_block_size is None
        assert fp8.moe == bf16.moe and fp8.num_hidden_layers == bf16.num_hidden_layers
        load_recipe({"model": {"synthetic": f"{name}-fp8", "device": "cuda"}})
    small = {**synthetic.SYNTHETIC["qwen3.5-35b-a3b-fp8"], "hidden_size": 256, "num_attention_heads": 2,
             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 128,
             "shared_expert_intermediate_size": 128, "num_hidden_layers": 4, "num_experts": 16,
             "vocab_size": 1024}  # fmt: skip
    monkeypatch.setitem(synthetic.SYNTHETIC, "small-moe-fp8", small)
    model = synthetic.synthetic_model("small-moe-fp8", torch.bfloat16, "cpu")
    experts = experts_of(model)
    assert all(e.gate_up_proj.dtype == E4M3 for e in experts)
    assert model.model.layers[0].mlp.router.weight.dtype == torch.bfloat16
    weight = dequantize_fp8_block(experts[0].gate_up_proj, experts[0].gate_up_proj_scale_inv)
    assert 0.5 < weight.std().item() * 256**0.5 < 2.0  # weights of scale 1/sqrt(K)
    scales = 4 * (2 * 2 + 2 * 1)  # fp32 grids: gate/up [256 rows, 256 cols] and down [256, 128] in 128-blocks
    assert moe_expert_bytes(model)["target_moe"] == [(16, 8, 3 * 128 * 256 + scales)] * 4
    with torch.inference_mode():
        assert model(torch.arange(8)[None]).isfinite().all()
