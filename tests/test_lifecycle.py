"""Request lifecycle: cancellation, re-admission, reclamation of every page and state row, pressure, bad
input at submit, and a long randomized run with no leaks and solo-identical tokens."""

import random

import pytest
from helpers import random_prompt

from qwen_mtp import Engine, RequestError, SamplingParams


def make_engine(path, **cache):
    recipe = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "cache": cache}
    return Engine.from_recipe(recipe, log=lambda _: None)


def assert_all_reclaimed(engine):
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"]
    assert stats["free_state_rows"] == stats["total_state_rows"]
    assert stats["running"] == stats["waiting"] == 0
    assert not engine.pages.tables and not engine.states.rows and engine.pages.available_pages == stats["total_pages"]


def run_until(engine, predicate, limit=500):
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError("condition never reached")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from qwen_mtp.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")


def solo(path, prompt, max_new, **cache):
    return make_engine(path, **cache).generate([prompt], max_new_tokens=max_new, ignore_eos=True)[0].token_ids


def test_cancel_mid_prefill_and_resubmit(path):
    engine = make_engine(path, prefill_chunk=8, page_size=8)
    prompt = random_prompt(40, seed=1)
    rid = engine.submit(prompt, SamplingParams(10, ignore_eos=True))
    engine.step()
    engine.step()
    request = engine.requests[rid]
    assert (
        request.in_prefill
        and request.num_computed == 16
        and engine.stats()["free_pages"] < engine.stats()["total_pages"]
    )
    assert engine.cancel(rid) and not engine.cancel(rid)
    assert engine.result(rid).finish_reason == "cancelled"
    assert_all_reclaimed(engine)
    again = engine.generate([prompt], max_new_tokens=10, ignore_eos=True)[0]
    assert again.token_ids == solo(path, prompt, 10, prefill_chunk=8, page_size=8)
    assert_all_reclaimed(engine)


def test_cancel_mid_decode_and_resubmit_gives_same_tokens(path):
    engine = make_engine(path, page_size=4)
    prompts = [random_prompt(n, seed=n) for n in (12, 5)]
    first = engine.submit(prompts[0], SamplingParams(20, ignore_eos=True))
    other = engine.submit(prompts[1], SamplingParams(20, ignore_eos=True))
    run_until(engine, lambda: len(engine.requests[first].output) >= 6)
    partial = list(engine.requests[first].output)
    engine.cancel(first)
    run_until(engine, lambda: engine.requests[other].done)
    assert_all_reclaimed(engine)
    full = engine.generate([prompts[0]], max_new_tokens=20, ignore_eos=True)[0].token_ids
    assert full[: len(partial)] == partial
    assert full == solo(path, prompts[0], 20, page_size=4)
    assert engine.result(other).token_ids == solo(path, prompts[1], 20, page_size=4)


def test_pressure_more_requests_than_pages_and_rows(path):
    """6 requests, room for 2 at a time: all complete, admitted in submission order, with solo tokens."""
    engine = make_engine(path, page_size=8, num_pages=8, num_state_rows=2, max_batch=4)
    prompts = [random_prompt(n, seed=n) for n in (20, 9, 25, 3, 14, 30)]
    ids = [engine.submit(p, SamplingParams(8, ignore_eos=True)) for p in prompts]
    admitted = []
    while engine.has_unfinished():
        engine.step()
        assert engine.stats()["running"] <= 2
        admitted += [r.id for r in engine.scheduler.running if r.id not in admitted]
    assert admitted == ids
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.result(rid).token_ids == solo(path, prompt, 8)
    assert_all_reclaimed(engine)


def test_bad_requests_are_refused_and_allocate_nothing(path):
    engine = make_engine(path, page_size=8, num_pages=4)
    good = engine.submit(random_prompt(10, seed=0), SamplingParams(5, ignore_eos=True))
    engine.step()
    before = engine.stats()
    for prompt, max_new, message in [
        ([], 3, "empty prompt"),
        ([1, 99999], 3, "outside the vocabulary"),
        ([1, 2], 0, "max_new_tokens must be an integer >= 1"),
        ([1] * 30, 10, "needs 5 KV pages but the whole pool has 4"),
        ([1] * 4090, 10, "max_position_embeddings"),
    ]:
        with pytest.raises(RequestError, match=message):
            engine.submit(prompt, SamplingParams(max_new))
    assert engine.stats() == before
    run_until(engine, lambda: engine.requests[good].done)
    assert engine.result(good).token_ids == solo(path, random_prompt(10, seed=0), 5)
    assert_all_reclaimed(engine)


def test_randomized_lifecycle_no_leaks_and_solo_tokens(path):
    """Seeded arrivals, cancellations and lengths over hundreds of steps under memory pressure."""
    rng = random.Random(1234)
    cache = {"page_size": 8, "num_pages": 24, "num_state_rows": 3, "max_batch": 3, "prefill_chunk": 16}
    engine = make_engine(path, **cache)
    submitted, cancelled, steps = {}, set(), 0
    while steps < 300 or engine.has_unfinished():
        if steps < 300 and rng.random() < 0.3:
            prompt = random_prompt(rng.randint(1, 60), seed=rng.randint(0, 10**6))
            max_new = rng.randint(1, 20)
            submitted[engine.submit(prompt, SamplingParams(max_new, ignore_eos=True))] = (prompt, max_new)
        live = [rid for rid in submitted if not engine.requests[rid].done]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            engine.cancel(victim)
            cancelled.add(victim)
        engine.step()
        steps += 1
        stats = engine.stats()
        assert 0 <= stats["free_pages"] <= stats["total_pages"] and engine.pages.available_pages >= 0
    assert_all_reclaimed(engine)
    finished = [rid for rid in submitted if rid not in cancelled]
    assert len(finished) > 40 and len(cancelled) > 3
    reference = make_engine(path, **cache)
    for rid in finished:
        prompt, max_new = submitted[rid]
        result = engine.result(rid)
        assert result.finish_reason == "length" and len(result.token_ids) == max_new
        assert result.token_ids == reference.generate([prompt], max_new_tokens=max_new, ignore_eos=True)[0].token_ids
