"""Full-sequence logits of our model equal Hugging Face's on the same checkpoint files."""

import pytest
import torch
from helpers import load_hf
from transformers import AutoConfig, AutoModelForCausalLM

from qwen_mtp import ModelConfig, load_model
from qwen_mtp.model import QwenHybridForCausalLM

CASES = [
    ("tiny", "text", {}),
    ("tiny", "vlm", {}),
    ("tiny-tied", "text", {}),
    ("tiny-tied", "vlm", {}),
    ("tiny-8l", "text", {}),
    ("tiny", "text", {"shards": 3}),
]


@pytest.mark.parametrize("preset,layout,extra", CASES)
def test_fp32_logits_match_hf(checkpoint, preset, layout, extra):
    path = checkpoint(preset, layout, **extra)
    ids = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(0))  # > 2 GDN chunks
    with torch.inference_mode():
        ours = load_model(path, dtype=torch.float32)(ids)
        ref = load_hf(path, torch.float32)(ids).logits
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-5, f"max relative error {rel:.3g}"


@pytest.mark.parametrize("preset,layout", [("tiny", "text"), ("tiny-tied", "vlm"), ("tiny-8l", "text")])
def test_bf16_logits_match_hf_within_ulps(checkpoint, preset, layout):
    path = checkpoint(preset, layout, dtype="bfloat16")
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = load_model(path, dtype=torch.bfloat16)(ids)
        ref = load_hf(path, torch.bfloat16)(ids).logits
    assert ours.dtype == ref.dtype == torch.bfloat16
    # "a few ulp": at most 2 bf16 ulps of the reference value anywhere (bit-exact in practice).
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=2**-10)
    assert ((ours.float() - ref.float()).abs() <= 2 * ulp).all()


def test_fp32_weights_loaded_into_bf16_match_hf(checkpoint):
    """Casting fp32 files to bf16 at load time rounds exactly as HF does (A_log and dt_bias included)."""
    path = checkpoint("tiny")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours = load_model(path, dtype="bfloat16")(ids)
        ref = load_hf(path, torch.bfloat16)(ids).logits
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])  # dense, and MoE (router and experts included)
def test_gradients_match_hf_for_fine_tuning(checkpoint, preset):
    """The loaded module trains: a language-model loss backpropagates to the same gradients as HF's."""
    path = checkpoint(preset)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    ours, ref = load_model(path, dtype=torch.float32), load_hf(path, torch.float32)
    loss = torch.nn.functional.cross_entropy(ours(ids)[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
    ref_loss = ref(ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    slots = ours.checkpoint_slots()
    for name, param in ref.named_parameters():  # every tensor HF has, each segment of a merged projection too
        torch.testing.assert_close(slots[name].grad(), param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_gemm_projections_keep_state_dict_and_outputs(checkpoint):
    """The CUDA layout (each MergedLinear as one GEMM whose output the ops read as strided slices) holds the
    same tensors and computes the same logits as the per-projection products, and trains through the same path."""
    model = load_model(checkpoint("tiny"), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        expected = model(ids)
    model.use_one_gemm()
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    model(ids).float().pow(2).mean().backward()
    slots = model.checkpoint_slots()
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.layers.0.linear_attn.in_proj_b.weight",
                 "model.layers.0.mlp.up_proj.weight", "model.layers.3.self_attn.v_proj.weight"):  # fmt: skip
        assert slots[name].grad().abs().sum() > 0, name


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied", "tiny-8l"])
def test_state_dict_round_trips_through_hf_transformers(checkpoint, preset):
    """Our `state_dict()` loaded into Hugging Face's Qwen3.5 class gives HF the same logits as ours, and HF's
    `state_dict()` loaded into ours gives ours HF's logits: fp32, bit for bit. HF has no MTP head (`mtp.*`)
    and lists a tied lm_head under its own name too; nothing else may be missing or left over."""
    path = checkpoint(preset)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))
    ours = load_model(path, dtype=torch.float32)
    state = ours.state_dict()
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).eval()
    keys = hf.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")}, strict=False)
    assert keys.unexpected_keys == [] and keys.missing_keys == (["lm_head.weight"] if ours.tied else [])
    with torch.inference_mode():
        expected = ours(ids)
        assert torch.equal(hf(ids).logits, expected)

    fresh = QwenHybridForCausalLM(ModelConfig.from_pretrained(path))
    keys = fresh.load_state_dict(load_hf(path, torch.float32).state_dict(), strict=False)
    assert keys.unexpected_keys == [] and keys.missing_keys and all(k.startswith("mtp.") for k in keys.missing_keys)
    with torch.inference_mode():
        assert torch.equal(fresh.eval()(ids), expected)
