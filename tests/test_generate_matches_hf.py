"""Greedy tokens from `Engine.generate` equal Hugging Face `generate(do_sample=False)`."""

import pytest
import torch
from helpers import assert_greedy_matches_hf, hf_greedy, load_hf, random_prompt

from qwen_mtp import Engine

PROMPTS = [random_prompt(n, seed=n) for n in (1, 2, 7, 33, 70)]


@pytest.mark.parametrize(
    "preset,layout,dtype",
    [
        ("tiny", "text", "float32"),
        ("tiny", "vlm", "bfloat16"),
        ("tiny-tied", "vlm", "float32"),
        ("tiny-tied", "text", "bfloat16"),
        ("tiny-8l", "text", "float32"),
        ("tiny-8l", "text", "bfloat16"),
    ],
)
def test_greedy_tokens_match_hf(checkpoint, preset, layout, dtype):
    path = checkpoint(preset, layout)
    engine = Engine.from_recipe({"model": {"path": str(path), "dtype": dtype, "device": "cpu"}})
    results = engine.generate(PROMPTS, max_new_tokens=16, ignore_eos=True)
    hf = load_hf(path, getattr(torch, dtype))
    compared = sum(assert_greedy_matches_hf(r.token_ids, hf, p, 16) for p, r in zip(PROMPTS, results, strict=True))
    # fp32: every token. bf16: the tokens before HF's own near-ties (tests/helpers.py), a third at least.
    assert compared == 16 * len(PROMPTS) if dtype == "float32" else compared >= 16 * len(PROMPTS) // 3
    assert all(r.finish_reason == "length" for r in results)


def test_stops_at_eos_like_hf(checkpoint):
    """Force an early EOS by declaring the model's own 3rd greedy token a stop token."""
    path = checkpoint("tiny")
    engine = Engine.from_recipe({"model": {"path": str(path), "dtype": "float32", "device": "cpu"}})
    prompt = PROMPTS[2]
    free = engine.generate([prompt], max_new_tokens=8, ignore_eos=True)[0].token_ids
    stop = free[2]
    engine.eos_ids = {stop}
    result = engine.generate([prompt], max_new_tokens=8)[0]
    expected = hf_greedy(load_hf(path, torch.float32), prompt, 8, eos_ids=[stop])
    assert result.token_ids == expected == free[: free.index(stop) + 1]
    assert result.finish_reason == "stop"
