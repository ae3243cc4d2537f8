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
