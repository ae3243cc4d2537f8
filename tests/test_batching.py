"""Continuous batching is exact: a request's tokens never depend on what shares its batch, on how its prompt
is chunked, and they equal Hugging Face greedy output."""

import pytest
import torch
from helpers import assert_greedy_matches_hf, load_hf, random_prompt

from qwen_mtp import Engine

LENGTHS = (1, 3, 17, 64, 65, 100, 9, 40)


def make_engine(path, dtype="float32", **cache):
    recipe = {"model": {"path": str(path), "dtype": dtype, "device": "cpu"}, "cache": cache}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-8l"])
def test_batch_equals_single_equals_hf(checkpoint, preset, dtype):
    path = checkpoint(preset)
    prompts = [random_prompt(n, seed=10 + n) for n in LENGTHS]
    engine = make_engine(path, dtype, max_batch=8, prefill_chunk=512)
    batched = [r.token_ids for r in engine.generate(prompts, max_new_tokens=12, ignore_eos=True)]
    alone = [engine.generate([p], max_new_tokens=12, ignore_eos=True)[0].token_ids for p in prompts]
    assert batched == alone  # exact in both dtypes: a request's tokens never depend on its batch
    hf = load_hf(path, getattr(torch, dtype))
    compared = sum(assert_greedy_matches_hf(ours, hf, p, 12) for ours, p in zip(batched, prompts, strict=True))
    # fp32: every token. bf16: the tokens before HF's own near-ties (tests/helpers.py), a third at least.
    assert compared == 12 * len(prompts) if dtype == "float32" else compared >= 12 * len(prompts) // 3


@pytest.mark.parametrize("chunk", [7, 64, 100, 101, 512])
def test_chunked_prefill_equals_unchunked(checkpoint, chunk):
    """Chunks smaller than, equal to and larger than the 101-token prompt give the unsplit tokens."""
    path = checkpoint("tiny")
    prompt = random_prompt(101, seed=5)
    whole = make_engine(path, prefill_chunk=4096).generate([prompt], max_new_tokens=16, ignore_eos=True)
    split = make_engine(path, prefill_chunk=chunk).generate([prompt], max_new_tokens=16, ignore_eos=True)
    assert split[0].token_ids == whole[0].token_ids


def test_chunked_prefill_in_a_mixed_batch(checkpoint):
    """Requests in prefill (several chunks) and in decode share steps; each still gets its solo tokens."""
    path = checkpoint("tiny-8l")
    engine = make_engine(path, prefill_chunk=16, max_batch=4)
    prompts = [random_prompt(n, seed=n) for n in (5, 80, 33, 2, 47, 16)]
    batched = [r.token_ids for r in engine.generate(prompts, max_new_tokens=10, ignore_eos=True)]
    assert batched == [engine.generate([p], max_new_tokens=10, ignore_eos=True)[0].token_ids for p in prompts]


def test_stream_yields_every_token_once(checkpoint):
    engine = make_engine(checkpoint("tiny"))
    prompts = [random_prompt(n, seed=n) for n in (4, 30)]
    expected = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6, ignore_eos=True)]
    got = {}
    finished = []
    for update in engine.stream(prompts, max_new_tokens=6, ignore_eos=True):
        got.setdefault(update.request_id, []).extend(update.new_token_ids)
        if update.finished:
            finished.append(update.request_id)
    assert list(got.values()) == expected and sorted(finished) == sorted(got)
