"""Lossless MTP on the MoE families: MTP-on tokens == MTP-off tokens for K = 1..4 at batch 1 and 8 (the MTP
block's own MoE included), with the real head's drafts and with oracle drafts that are mostly accepted."""

import functools

import pytest
from helpers import random_prompt

from qwen_mtp import Engine

MAX_NEW = 10


def make_engine(path, dtype, k=None, draft="head"):
    recipe = {"model": {"path": str(path), "dtype": dtype, "device": "cpu"}, "cache": {"prefill_chunk": 32}}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": 0.8}
    return Engine.from_recipe(recipe, log=lambda _: None)


# mixed lengths, including 1 and K+1 for every K (a verify of the whole prompt's length)
PROMPTS = tuple(tuple(random_prompt(n, seed=200 + n)) for n in (1, 5, 2, 33, 3, 70, 4, 19))


def generate(engine, prompts):
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)]


@functools.cache
def plain(path, dtype):
    return generate(make_engine(path, dtype), [list(p) for p in PROMPTS])


@pytest.mark.parametrize(
    "preset,dtype,k,draft",
    [
        ("tiny-moe", "float32", 1, "head"),
        ("tiny-next", "bfloat16", 2, "oracle"),
        ("tiny-moe", "bfloat16", 3, "oracle"),
        ("tiny-next", "float32", 4, "head"),
    ],
)
def test_mtp_matches_plain_batch1_and_batch8(checkpoint, preset, dtype, k, draft):
    path = checkpoint(preset)
    prompts = [list(p) for p in PROMPTS]
    off = plain(str(path), dtype)
    spec = make_engine(path, dtype, k=k, draft=draft)
    assert generate(spec, prompts) == off  # batch 8
    assert [generate(spec, [p])[0] for p in prompts[:2]] == off[:2]  # batch 1
    stats = spec.stats()
    assert stats["verify_steps"] > 0
    if draft == "oracle":  # most drafts accepted: verify steps of K+1 tokens did commit several positions
        assert stats["position_acceptance"][0] > 0.5
    assert stats["free_pages"] == stats["total_pages"] and stats["free_state_rows"] == stats["total_state_rows"]
