"""Full-sequence logits of our model equal Hugging Face's on the same checkpoint files."""

import pytest
import torch
from helpers import load_hf

from qwen_mtp import load_model

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


def test_gradients_match_hf_for_fine_tuning(checkpoint):
    """The loaded module trains: a language-model loss backpropagates to the same gradients as HF's."""
    path = checkpoint("tiny")
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    ours, ref = load_model(path, dtype=torch.float32), load_hf(path, torch.float32)
    loss = torch.nn.functional.cross_entropy(ours(ids)[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
    ref_loss = ref(ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_params = dict(ref.named_parameters())
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.3.self_attn.q_norm.weight",
                 "model.layers.1.linear_attn.norm.weight", "model.norm.weight", "lm_head.weight"):  # fmt: skip
        grad = dict(ours.named_parameters())[name].grad
        torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fused_projections_keep_parameters_and_outputs(checkpoint):
    """`fuse_projections` (CUDA engines) changes how the projections launch, not what the model holds; and a
    model that was fused still trains through the separate (differentiable) path."""
    model = load_model(checkpoint("tiny"), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        expected = model(ids)
    model.fuse_projections()
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    layers = model.model.layers
    gdn = next(layer.linear_attn for layer in layers if layer.mixer == "gdn")
    attn = next(layer.self_attn for layer in layers if layer.mixer != "gdn")
    for fused, first, last in (
        (layers[0].mlp.gate_up, layers[0].mlp.gate_proj, layers[0].mlp.up_proj),
        (gdn.in_proj, gdn.in_proj_qkv, gdn.in_proj_a),
        (attn.qkv, attn.q_proj, attn.v_proj),
    ):  # views of the fused tensor, in order, covering it
        assert first.weight.data_ptr() == fused.data_ptr()
        assert last.weight.data_ptr() + last.weight.numel() * last.weight.element_size() == (
            fused.data_ptr() + fused.numel() * fused.element_size()
        )
    model(ids).float().pow(2).mean().backward()
    assert attn.k_proj.weight.grad is not None and gdn.in_proj_b.weight.grad is not None
