"""Prefix caching on CUDA (Triton prefill kernels, CUDA graphs): cached == uncached tokens and MTP drafts for a
6-turn conversation (fp32 and bf16 GDN state), and the 200-prompt stress run with a shared-prefix mix, exact
against caching off, MTP off and on."""

import gc
import random

import pytest
import torch
from helpers import random_prompt
from prefix_helpers import converse, drain

from qwen_mtp import Engine, SamplingParams


def engine_for(source, caching, k=None, draft="head", accept=1.0, max_batch=8, state_dtype="float32", **cache):
    # explicit page counts: several engines live at once here, each must not claim most of the GPU
    cache = {
        "max_batch": max_batch, "num_state_rows": max_batch, "num_pages": 40 * max_batch, "prefix_caching": caching,
        **cache,
    }  # fmt: skip
    recipe = {"model": {**source, "dtype": "bfloat16", "device": "cuda"}, "cache": cache}
    recipe["state"], recipe["compile"] = {"dtype": state_dtype}, {"cuda_graphs": True}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": accept}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [None, 2])
def test_conversation_cached_matches_uncached_cuda(k, state_dtype):
    source, chunks = {"fixture": "tiny-8l"}, {"prefill_chunk": 64, "page_size": 32}
    turns = [random_prompt(70 + 9 * t, seed=10 + t) for t in range(6)]
    cold = converse(engine_for(source, False, k, state_dtype=state_dtype, **chunks), turns, max_new=24)
    cached = converse(engine_for(source, True, k, state_dtype=state_dtype, **chunks), turns, max_new=24)
    assert [c[:2] for c in cached] == [c[:2] for c in cold]  # tokens and every draft
    assert all(c[2] > 0 for c in cached[1:]), [c[2] for c in cached]  # every later turn restored a prefix


@pytest.mark.parametrize("k", [None, 2])
def test_stress_shared_prefix_mix_cached_matches_uncached(k):
    """200 prompts arriving while others run, 128 new tokens: a quarter unique (1..2048 tokens), most sharing
    one of 4 system prompts (512..2048 tokens) before their own question, some asked again. With MTP, oracle
    drafts (70% accepted) so verifies accept several tokens."""
    rng = random.Random(21)
    systems = [random_prompt(n, seed=n, vocab=200000) for n in (512, 1024, 1536, 2048)]
    prompts = []
    for i in range(200):
        kind = rng.random()
        if kind < 0.25:
            prompts.append(random_prompt(rng.randint(1, 2048), seed=1000 + i, vocab=200000))
        elif kind < 0.85 or not prompts:
            prompts.append(rng.choice(systems) + random_prompt(rng.randint(1, 300), seed=2000 + i, vocab=200000))
        else:
            prompts.append(rng.choice(prompts))  # asked again
    source, params = {"synthetic": "qwen3.5-0.8b"}, SamplingParams(128, ignore_eos=True)
    plain = engine_for(source, False, max_batch=64, prefill_chunk=512)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    del plain
    gc.collect()  # an engine's callbacks form reference cycles
    torch.cuda.empty_cache()
    engine = engine_for(source, True, k, "oracle", 0.7, max_batch=64, prefill_chunk=512)
    ids = []
    for i, prompt in enumerate(prompts):  # staggered arrivals: the batch mix changes every few steps
        if k is None:
            ids.append(engine.submit(prompt, params))
        else:
            ids.append(engine.submit_with_oracle(prompt, expected[i], params))
        if i % 3 == 0:
            engine.step()
    drain(engine)
    assert [engine.result(i).token_ids for i in ids] == expected
    stats = engine.stats()
    assert stats["prefix_hits"] >= 50 and stats["prefix_tokens_saved"] >= 50 * 512, stats
    engine.clear_prefix_cache()
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"], stats
    assert stats["prefix_free_snapshot_slots"] == stats["prefix_snapshot_slots"], stats
