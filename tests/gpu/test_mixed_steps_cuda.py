"""Mixed steps on CUDA (the batch-invariant Triton GEMM at packed-prefill row counts, the Triton GDN kernels over
all chunks (varlen), the prefill attention kernel per chunk, CUDA graphs for the decode rows): a request's tokens
do not depend on what its chunks were packed with, MTP off and on; each chunk's hidden states and GDN states
packed are bitwise those alone; and the 200-prompt stress run (lengths 1..2048, staggered arrivals) packed ==
every request alone, MTP-on == MTP-off."""

import gc
import random

import pytest
import torch
from helpers import random_prompt
from prefix_helpers import drain

from qwen_mtp import Engine, SamplingParams


def engine_for(source, k=None, draft="head", accept=1.0, max_batch=8, **cache):
    # explicit page counts: several engines live at once here, each must not claim most of the GPU
    cache = {
        "max_batch": max_batch, "num_state_rows": max_batch, "num_pages": 40 * max_batch, "mixed_steps": True,
        **cache,
    }  # fmt: skip
    recipe = {"model": {**source, "dtype": "bfloat16", "device": "cuda"}, "cache": cache}
    recipe["compile"] = {"cuda_graphs": True}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": accept}
    return Engine.from_recipe(recipe, log=lambda _: None)


def free(engine):
    del engine
    gc.collect()  # an engine's callbacks form reference cycles
    torch.cuda.empty_cache()


SOURCES = {"bf16": {"fixture": "tiny-8l"}, "fp8": {"synthetic": "qwen3.5-0.8b-fp8"}}  # FP8: W8A8 prefill plans


@pytest.mark.parametrize("weights", sorted(SOURCES))
@pytest.mark.parametrize("k", [None, 2])
def test_tokens_do_not_depend_on_packing_cuda(k, weights):
    source, chunks = SOURCES[weights], {"prefill_chunk": 64, "page_size": 32}
    target = random_prompt(150, seed=1)
    others = [random_prompt(n, seed=10 + n) for n in (130, 70, 200, 64, 99, 180, 30)]
    alone = engine_for(source, k, **chunks).generate([target], max_new_tokens=24, ignore_eos=True)[0].token_ids
    engine = engine_for(source, k, max_batch=10, **chunks)
    decoders = [engine.submit(random_prompt(5, seed=s), SamplingParams(60, ignore_eos=True)) for s in (2, 3)]
    engine.step()
    packed = engine.generate([target] + others, max_new_tokens=24, ignore_eos=True)[0].token_ids
    drain(engine)
    assert packed == alone
    assert all(engine.result(r).finish_reason == "length" for r in decoders)


@pytest.mark.parametrize("k", [None, 2])
def test_stress_packed_matches_alone_and_mtp_matches_plain(k):
    """200 prompts of 1..2048 tokens arriving while others run, 64 new tokens: every request's tokens equal its
    tokens alone (max_batch 1: nothing to pack with); with MTP (oracle drafts, 70% accepted) too."""
    rng = random.Random(20)
    prompts = [random_prompt(rng.randint(1, 2048), seed=3000 + i, vocab=200000) for i in range(200)]
    source, params = {"synthetic": "qwen3.5-0.8b"}, SamplingParams(64, ignore_eos=True)
    solo = engine_for(source, max_batch=1, prefill_chunk=512)
    expected = [solo.generate([p], params)[0].token_ids for p in prompts]
    free(solo)
    engine = engine_for(source, k, "oracle", 0.7, max_batch=64, prefill_chunk=512, max_step_tokens=8192)
    ids = []
    for i, prompt in enumerate(prompts):  # staggered arrivals: the packing changes every few steps
        ids.append(
            engine.submit(prompt, params) if k is None else engine.submit_with_oracle(prompt, expected[i], params)
        )
        if i % 3 == 0:
            engine.step()
    drain(engine)
    assert [engine.result(i).token_ids for i in ids] == expected


@pytest.mark.parametrize("source", [{"fixture": "tiny-8l"}, {"synthetic": "qwen3.5-0.8b"}], ids=["tiny", "0.8b"])
def test_packed_gdn_varlen_equals_each_chunk_alone_cuda(source, monkeypatch):
    """tests/test_packed_gdn.py with the Triton kernels: each chunk of a packed step (1, 50, 64 and 130 tokens, one
    continuing an earlier chunk's state) gets from the one varlen GDN call per layer bitwise the hidden states and
    GDN states that `gdn_chunked` gives it alone."""
    from test_packed_gdn import assert_packed_equals_alone

    assert_packed_equals_alone(source, "bfloat16", "cuda", monkeypatch, num_state_rows=4, num_pages=64)
    gc.collect()
    torch.cuda.empty_cache()
