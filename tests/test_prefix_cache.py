"""Prefix caching: with `cache.prefix_caching` every request's tokens, and with MTP its drafts, equal a cold run's
(caching off), MTP off and K=2, fp32 and bf16 (model and GDN state): a 6-turn conversation (the turns restore
the previous turns' prompt and output chunks), 20 requests sharing a 3-chunk system prompt with staggered
arrivals and cancellations, and eviction under pools too small to keep everything, with every page and snapshot
slot back after clearing the cache. Different tokens never share a chunk, and an MTP request shares a chunk only
when the token after it matches (the MTP KV of a chunk's last position is computed from that token)."""

import pytest
from helpers import random_prompt
from prefix_helpers import Recorder, converse, drain

from qwen_mtp import Engine, RecipeError, SamplingParams

CHUNK = 8  # prefill chunk = page size: one page per chunk, cheap chunks
DTYPES = [("float32", "float32"), ("bfloat16", "bfloat16")]  # (model dtype, GDN state dtype)


def make_engine(path, dtypes=DTYPES[0], k=None, caching=True, **cache):
    cache = {"prefill_chunk": CHUNK, "page_size": CHUNK, "prefix_caching": caching, **cache}
    recipe = {
        "model": {"path": str(path), "dtype": dtypes[0], "device": "cpu"},
        "state": {"dtype": dtypes[1]},
        "cache": cache,
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from qwen_mtp.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.mark.parametrize("dtypes", DTYPES, ids=["fp32", "bf16"])
def test_conversation_cached_matches_uncached(path, dtypes):
    turns = [random_prompt(6, seed=10 + t) for t in range(6)]
    max_new = 5
    cold = converse(make_engine(path, dtypes, k=2, caching=False), turns, max_new)  # outputs == MTP off's
    spec = make_engine(path, dtypes, k=2)
    cached = converse(spec, turns, max_new)
    plain = converse(make_engine(path, dtypes), turns, max_new)
    assert [c[:2] for c in cached] == [c[:2] for c in cold]  # tokens and every draft
    assert [p[0] for p in plain] == [c[0] for c in cold]
    # every turn after the first restores the previous turns' full chunks, prompt and output (cache fills)
    history = 0
    for t, (_, _, restored) in enumerate(cached):
        if t:
            assert restored == (history - 1) // CHUNK * CHUNK
        history += len(turns[t]) + max_new
    assert [p[2] for p in plain] == [c[2] for c in cached]
    stats = spec.stats()
    assert stats["prefix_hits"] == 5 and stats["prefix_tokens_saved"] == sum(c[2] for c in cached)


@pytest.mark.parametrize("dtypes", DTYPES, ids=["fp32", "bf16"])
def test_shared_system_prompt_staggered_with_cancellations(path, dtypes):
    system = random_prompt(3 * CHUNK, seed=1) + [7, 8]  # 3 chunks, then the template tokens of a user turn
    prompts = [system + random_prompt(3 + i % 7, seed=100 + i) for i in range(20)]
    max_new = 4
    reference = Recorder(make_engine(path, dtypes, k=2, caching=False, max_batch=8))
    for prompt in prompts:
        reference.submit(prompt, max_new)
    reference.finish()
    expected = [(reference.outputs[r], reference.drafts[r]) for r in sorted(reference.outputs)]
    for k in (None, 2):
        engine = make_engine(path, dtypes, k=k, max_batch=4)
        recorder, ids, cancelled, steps = Recorder(engine), [], set(), 0
        cancel_after = {4: 3, 9: 7, 18: 13, 13: 16}  # request -> the step after which it is cancelled
        while len(ids) < len(prompts) or recorder.live:
            for prompt in prompts[len(ids) : len(ids) + 2]:  # two arrivals a step
                ids.append(recorder.submit(prompt, max_new))
            recorder.step()
            steps += 1
            for i, after in cancel_after.items():
                if after == steps and ids[i] in recorder.live:
                    recorder.cancel(ids[i])
                    cancelled.add(ids[i])
        recorder.finish()
        assert len(cancelled) >= 3
        for rid, (tokens, drafts) in zip(ids, expected, strict=True):
            got = recorder.outputs[rid]
            if rid in cancelled:
                assert got == tokens[: len(got)]
            else:
                assert got == tokens
            if k is not None:
                assert recorder.drafts[rid] == drafts[: len(recorder.drafts[rid])]
        stats = engine.stats()
        assert stats["prefix_hits"] >= 12 and stats["prefix_tokens_saved"] >= 12 * 3 * CHUNK
        assert_reclaimed_after_clear(engine)


def assert_reclaimed_after_clear(engine):
    drain(engine)
    engine.clear_prefix_cache()
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and engine.pages.available_pages == stats["total_pages"]
    assert stats["prefix_free_snapshot_slots"] == stats["prefix_snapshot_slots"]
    assert stats["prefix_cached_pages"] == stats["prefix_cached_chunks"] == 0
    assert stats["free_state_rows"] == stats["total_state_rows"] and stats["running"] == stats["waiting"] == 0
    assert not engine.pages.tables and not engine.states.rows


@pytest.mark.parametrize("k", [None, 2], ids=["plain", "k2"])
@pytest.mark.parametrize("limit", ["pages", "snapshots"])
def test_eviction_under_small_pools_is_exact_and_leaks_nothing(path, k, limit):
    # 6 prompt families of 4 chunks, each asked twice, far apart: the cache cannot keep all of them
    families = [random_prompt(4 * CHUNK, seed=200 + f) for f in range(6)]
    prompts = [f + random_prompt(3, seed=300 + i) for i, f in enumerate(families + families[::-1])]
    pools = {"pages": {"num_pages": 20, "prefix_snapshots": 64}, "snapshots": {"num_pages": 64, "prefix_snapshots": 3}}
    engine = make_engine(path, k=k, max_batch=2, **pools[limit])
    expected = make_engine(path, k=k, caching=False).generate(prompts, max_new_tokens=3, ignore_eos=True)
    for prompt, want in zip(prompts, expected, strict=True):
        assert engine.generate([prompt], max_new_tokens=3, ignore_eos=True)[0].token_ids == want.token_ids
        stats = engine.stats()
        assert stats["prefix_free_snapshot_slots"] + stats["prefix_cached_snapshots"] == stats["prefix_snapshot_slots"]
    stats = engine.stats()
    assert stats["prefix_evictions"] > 0 and stats["prefix_hits"] > 0
    assert_reclaimed_after_clear(engine)


def test_different_tokens_of_the_same_length_never_share(path):
    base = random_prompt(3 * CHUNK + 4, seed=5)
    engine = make_engine(path)
    cold = make_engine(path, caching=False)
    variants = [base, base[:-1] + [base[-1] ^ 1]]  # same chunks, other last token: all 3 chunks shared
    for position in (CHUNK + 3, CHUNK - 1, 0):  # one token differs in chunk 1, at the end / start of chunk 0
        variant = list(base)
        variant[position] = 3 + (variant[position] + 1) % 500
        variants.append(variant)
    restored = []
    for prompt in variants:
        rid = engine.submit(prompt, SamplingParams(4, ignore_eos=True))
        request = engine.requests[rid]
        drain(engine)
        restored.append(request.cached_tokens)
        assert engine.result(rid).token_ids == cold.generate([prompt], max_new_tokens=4, ignore_eos=True)[0].token_ids
    assert restored == [0, 3 * CHUNK, CHUNK, 0, 0]


def test_a_cancelled_requests_full_chunks_stay_cached(path):
    prompt = random_prompt(4 * CHUNK + 2, seed=8)
    engine = make_engine(path, k=2)
    rid = engine.submit(prompt, SamplingParams(4, ignore_eos=True))
    engine.step()
    engine.step()  # two chunks prefilled
    engine.cancel(rid)
    drain(engine)
    assert engine.stats()["prefix_fills"] == 0  # no output: nothing more is computed for it
    again = Recorder(engine)
    rid = again.submit(prompt, 4)
    request = engine.requests[rid]
    again.finish()
    cold = Recorder(make_engine(path, k=2, caching=False))
    cold_id = cold.submit(prompt, 4)
    cold.finish()
    assert request.cached_tokens == 2 * CHUNK
    assert again.outputs[rid] == cold.outputs[cold_id] and again.drafts[rid] == cold.drafts[cold_id]


def test_mtp_shares_a_chunk_only_with_the_same_next_token(path):
    shared = random_prompt(2 * CHUNK, seed=6)
    first, second = shared + [11, 12, 13], shared + [21, 22, 23]  # differ right at the chunk boundary
    for k, restored in ((None, 2 * CHUNK), (2, CHUNK)):
        engine = make_engine(path, k=k, prefix_cache_outputs=False)
        cold = Recorder(make_engine(path, k=k, caching=False))
        cold_id = cold.submit(second, 4)
        cold.finish()
        engine.generate([first], max_new_tokens=4, ignore_eos=True)
        recorder = Recorder(engine)
        rid = recorder.submit(second, 4)
        request = engine.requests[rid]
        recorder.finish()
        assert request.cached_tokens == restored
        assert recorder.outputs[rid] == cold.outputs[cold_id] and recorder.drafts[rid] == cold.drafts[cold_id]


def test_prefix_caching_needs_chunks_of_whole_pages(path):
    with pytest.raises(RecipeError, match="multiple of cache.page_size"):
        make_engine(path, prefill_chunk=12, page_size=8)
