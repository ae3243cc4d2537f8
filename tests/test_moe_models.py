"""Qwen3.5-MoE and Qwen3-Next: our logits and greedy tokens equal Hugging Face's on the same checkpoint files
(both expert layouts, both Qwen3.5-MoE checkpoint layouts), the state dict round-trips through HF's classes, and
the router picks what HF's picks, ties included."""

import pytest
import torch
from helpers import assert_greedy_matches_hf, load_hf, random_prompt
from transformers import AutoConfig, AutoModelForCausalLM

from qwen_mtp import CheckpointError, Engine, ModelConfig, load_model
from qwen_mtp.model import QwenHybridForCausalLM

CASES = [  # (preset, checkpoint layout, expert layout)
    ("tiny-moe", "text", "fused"),
    ("tiny-moe", "vlm", "fused"),
    ("tiny-moe", "text", "per_expert"),
    ("tiny-next", "text", "per_expert"),
    ("tiny-next", "text", "fused"),
]


@pytest.mark.parametrize("preset,layout,experts", CASES)
def test_fp32_logits_equal_hf_bit_for_bit(checkpoint, preset, layout, experts):
    path = checkpoint(preset, layout, experts=experts)
    ids = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(0))  # > 2 GDN chunks
    with torch.inference_mode():
        ours = load_model(path, dtype=torch.float32)(ids)
        ref = load_hf(path, torch.float32)(ids).logits
    assert torch.equal(ours, ref), f"max difference {(ours - ref).abs().max():.3g}"


@pytest.mark.parametrize("preset,layout", [("tiny-moe", "vlm"), ("tiny-next", "text")])
def test_bf16_logits_equal_hf(checkpoint, preset, layout):
    path = checkpoint(preset, layout, dtype="bfloat16")
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = load_model(path, dtype=torch.bfloat16)(ids)
        ref = load_hf(path, torch.bfloat16)(ids).logits
    assert ours.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(ours, ref)


PROMPTS = [random_prompt(n, seed=n) for n in (1, 7, 70)]


@pytest.mark.parametrize(
    "preset,layout,dtype",
    [
        ("tiny-moe", "text", "float32"),
        ("tiny-moe", "vlm", "bfloat16"),
        ("tiny-next", "text", "float32"),
    ],
)
def test_greedy_tokens_match_hf(checkpoint, preset, layout, dtype):
    path = checkpoint(preset, layout)
    engine = Engine.from_recipe({"model": {"path": str(path), "dtype": dtype, "device": "cpu"}}, log=lambda _: None)
    results = engine.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    hf = load_hf(path, getattr(torch, dtype))
    compared = sum(assert_greedy_matches_hf(r.token_ids, hf, p, 12) for p, r in zip(PROMPTS, results, strict=True))
    # fp32: every token. bf16: the tokens before HF's own near-ties (tests/helpers.py), a third at least.
    assert compared == 12 * len(PROMPTS) if dtype == "float32" else compared >= 12 * len(PROMPTS) // 3


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-next"])
def test_state_dict_round_trips_through_hf_transformers(checkpoint, preset):
    """Our state_dict loads into HF's class with nothing missing or left over (but `mtp.*`) and gives HF our
    logits; HF's state_dict loaded into ours gives HF's logits: fp32, bit for bit."""
    path = checkpoint(preset)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))
    ours = load_model(path, dtype=torch.float32)
    state = ours.state_dict()
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).eval()
    keys = hf.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")}, strict=False)
    assert keys.unexpected_keys == [] and keys.missing_keys == []
    with torch.inference_mode():
        expected = ours(ids)
        assert torch.equal(hf(ids).logits, expected)
    fresh = QwenHybridForCausalLM(ModelConfig.from_pretrained(path))
    keys = fresh.load_state_dict(load_hf(path, torch.float32).state_dict(), strict=False)
    assert keys.unexpected_keys == [] and keys.missing_keys and all(k.startswith("mtp.") for k in keys.missing_keys)
    with torch.inference_mode():
        assert torch.equal(fresh.eval()(ids), expected)


def test_checkpoint_saved_by_transformers_loads(checkpoint, tmp_path):
    """What HF's `save_pretrained` writes (its own expert layout) loads into ours with HF's logits."""
    hf = load_hf(checkpoint("tiny-moe"), torch.float32)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert torch.equal(load_model(tmp_path, dtype=torch.float32)(ids), hf(ids).logits)


def test_router_ties_pick_the_experts_hf_picks(checkpoint):
    """Equal router logits (a zero router row set): the experts and weights are HF's, i.e. torch.topk's choice."""
    path = checkpoint("tiny-next")
    ours, hf = load_model(path, dtype=torch.float32), load_hf(path, torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6))
    ours_block, hf_block = ours.model.layers[0].mlp, hf.model.layers[0].mlp
    with torch.no_grad():
        ours_block.router.segment_weight("gate")[3:].zero_()
        hf_block.gate.weight[3:].zero_()
        ours_block.router.segment_weight("gate")[:3] = -10.0  # every token: experts 3..9 tie for the top 3
        hf_block.gate.weight[:3] = -10.0
    hf_scores, hf_ids = hf_block.gate(x)[1:]
    logits, _ = ours_block.router(x)
    weights, ids = torch.ops.qwen_mtp.moe_route(logits, 3, True)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_scores)
    with torch.inference_mode():
        assert torch.equal(ours_block(x[None]), hf_block(x[None]))


def test_missing_expert_tensor_is_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    source = checkpoint("tiny-next")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors .*model\.layers\.2\.mlp\.experts\.7\.up_proj\.weight"):
        load_model(tmp_path)


def test_fp8_per_expert_checkpoint_dequantizes(checkpoint):
    """A Qwen3-Next FP8 release's layout: e4m3 per-expert matrices and in_proj_qkvz with 128x128 block scales,
    routers and in_proj_ba in high precision; every expert slice and in_proj_qkvz hold their dequantized tensors,
    and the projections the model can keep in FP8 (whole 128-row segments) hold the checkpoint's e4m3 and scales."""
    from safetensors.torch import load_file

    from qwen_mtp.quant.fp8 import dequantize_fp8_block

    path = checkpoint("tiny-next", fp8=True)
    on_disk = load_file(path / "model.safetensors")
    assert on_disk["model.layers.0.mlp.experts.9.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["mtp.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["model.layers.0.linear_attn.in_proj_qkvz.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    model = load_model(path, dtype=torch.bfloat16)
    slots = model.checkpoint_slots() | {name: slot for name, (_, slot) in model.checkpoint_aliases().items()}
    kept = 0
    for name, tensor in on_disk.items():
        if name.endswith("_scale_inv"):
            continue
        stored = slots[name].tensor()
        if stored.dtype == torch.float8_e4m3fn:  # kept as stored: the e4m3 bytes and the block scales
            assert ".experts." not in name and "in_proj_qkvz" not in name, name
            assert torch.equal(stored.view(torch.uint8), tensor.view(torch.uint8)), name
            scale = on_disk[name + "_scale_inv"].float()
            assert torch.equal(slots[name + "_scale_inv"].tensor(), scale), name
            kept += 1
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8_block(tensor, on_disk[name + "_scale_inv"], (128, 128))
        assert torch.equal(stored, tensor.to(torch.bfloat16)), name
    assert kept > 0
