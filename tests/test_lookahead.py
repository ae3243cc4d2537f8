"""Lookahead (`cache.lookahead`): a plain decode or MTP verify step launched before the previous one's tokens are
read changes no token, logprob or finish reason, whatever ends a request (length, a stop token, a cancel) and
whoever arrives meanwhile; the chain stops and resumes around other work, and every page and state row comes
back."""

import random

import pytest
from helpers import RandomK, chained_launches, random_prompt, random_traffic

from qwen_mtp import Engine, SamplingParams

PROMPTS = [random_prompt(n, seed=40 + n) for n in (5, 12, 3, 20)]


def make_engine(path, lookahead, k=None, draft="head", **cache):
    cache = {"page_size": 8, "prefill_chunk": 16, "max_batch": 4, "lookahead": lookahead, **cache}
    recipe = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "cache": cache}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": 0.6}
    return Engine.from_recipe(recipe, log=lambda _: None)


def assert_all_reclaimed(engine):
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["free_state_rows"] == stats["total_state_rows"]
    assert stats["running"] == stats["waiting"] == 0


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from qwen_mtp.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")


def run(engine, params):
    ids = [engine.submit(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [engine.result(i) for i in ids]


def summary(results):
    return [(r.token_ids, r.finish_reason, r.logprobs) for r in results]


def test_lookahead_changes_no_token_whatever_ends_the_request(path):
    """Lengths from 1 to 14 new tokens (a request whose last decode is the step in flight, one that never
    decodes), and a stop token that ends one request mid-chain while the others go on."""
    plain = make_engine(path, lookahead=False)
    lengths = [1, 2, 9, 14]
    reference = run(plain, [SamplingParams(n, ignore_eos=True) for n in lengths])
    stop = reference[3].token_ids[6]  # request 3 stops at its 7th token (or earlier, at the token's first use)
    params = [
        SamplingParams(n, ignore_eos=True, stop_token_ids=[stop] if i == 3 else []) for i, n in enumerate(lengths)
    ]
    expected = run(plain, params)
    assert expected[3].finish_reason == "stop" and len(expected[3].token_ids) <= 7

    engine = make_engine(path, lookahead=True)
    assert summary(run(engine, params)) == summary(expected)
    assert engine.lookahead_steps > 0 and plain.lookahead_steps == 0
    assert_all_reclaimed(engine)


def test_lookahead_keeps_sampled_tokens_and_logprobs(path):
    params = [SamplingParams(10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i, logprobs=2) for i in range(4)]
    expected = run(make_engine(path, lookahead=False), params)
    engine = make_engine(path, lookahead=True)
    assert summary(run(engine, params)) == summary(expected)
    assert engine.lookahead_steps > 0


def test_lookahead_stops_for_arrivals_and_cancels_and_resumes(path):
    """A request arriving while a chain runs stops it (its prefill runs next), the chain resumes once it
    decodes too; a cancel between two steps drops the cancelled request's step in flight."""
    engine = make_engine(path, lookahead=True)
    first = [engine.submit(p, SamplingParams(16, ignore_eos=True)) for p in PROMPTS[:2]]
    for _ in range(5):
        engine.step()
    chained = engine.lookahead_steps
    assert chained > 0
    late = engine.submit(PROMPTS[2], SamplingParams(12, ignore_eos=True))
    engine.step()  # reads the step in flight; nothing launched ahead while the late request waits
    assert engine.lookahead_steps == chained
    for _ in range(3):
        engine.step()
    engine.cancel(first[1])
    while engine.has_unfinished():
        engine.step()
    assert engine.lookahead_steps > chained
    solo = make_engine(path, lookahead=False)
    for rid, prompt, n in ((first[0], PROMPTS[0], 16), (late, PROMPTS[2], 12)):
        assert engine.result(rid).token_ids == solo.generate([prompt], max_new_tokens=n, ignore_eos=True)[0].token_ids
    assert engine.result(first[1]).finish_reason == "cancelled"
    assert_all_reclaimed(engine)


def test_lookahead_randomized_arrivals_cancels_and_lengths(path):
    """Seeded arrivals, cancellations and lengths under memory pressure; every finished request equals its
    solo run, nothing leaks, and chains ran."""
    rng = random.Random(7)
    cache = {"num_pages": 20, "num_state_rows": 3, "max_batch": 3}
    engine = make_engine(path, True, **cache)

    def submit(rng):
        prompt, n = random_prompt(rng.randint(1, 30), seed=rng.randint(0, 10**6)), rng.randint(1, 16)
        return engine.submit(prompt, SamplingParams(n, ignore_eos=True)), (prompt, n)

    submitted, cancelled = random_traffic(engine, rng, 120, 0.12, 0.03, submit)
    assert_all_reclaimed(engine)
    assert engine.lookahead_steps > 10 and cancelled
    reference = make_engine(path, False, **cache)
    for rid, (prompt, n) in submitted.items():
        if rid not in cancelled:
            expected = reference.generate([prompt], max_new_tokens=n, ignore_eos=True)[0].token_ids
            assert engine.result(rid).token_ids == expected, rid


@pytest.mark.parametrize("draft", ["oracle", "head"])
@pytest.mark.parametrize("k", [1, 3])
def test_lookahead_verifies_equal_plain(path, k, draft):
    """MTP with lookahead: a verify launched before the one in flight is read starts where that one accepts up
    to (on the device) and drafts from its chain; the tokens are plain decoding's, stop tokens included."""
    plain = make_engine(path, lookahead=False)
    lengths = [2, 9, 14, 20]
    reference = run(plain, [SamplingParams(n, ignore_eos=True) for n in lengths])
    stop = reference[2].token_ids[8]
    # logprobs: a verify at a wrong position may still pick the tiny model's greedy tokens, not their logprobs
    params = [
        SamplingParams(n, ignore_eos=True, stop_token_ids=[stop] if i == 2 else [], logprobs=1)
        for i, n in enumerate(lengths)
    ]
    expected = run(plain, params)
    engine = make_engine(path, lookahead=True, k=k, draft=draft)
    if draft == "oracle":
        ids = [engine.submit_with_oracle(p, r.token_ids, q) for p, r, q in zip(PROMPTS, reference, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
        got = [engine.result(i) for i in ids]
    else:
        got = run(engine, params)
    assert summary(got) == summary(expected)
    assert engine.lookahead_steps > 0
    if draft == "oracle":  # the oracle's drafts were accepted: the staged windows followed the device's j
        assert engine.stats()["acceptance_length"] > 1.5
    assert_all_reclaimed(engine)


def test_lookahead_sampled_verifies_keep_tokens_and_logprobs(path):
    params = [SamplingParams(12, ignore_eos=True, temperature=0.8, seed=i, logprobs=1) for i in range(4)]
    expected = run(make_engine(path, lookahead=False), params)
    engine = make_engine(path, lookahead=True, k=2)
    assert summary(run(engine, params)) == summary(expected)
    assert engine.lookahead_steps > 0


def test_k_auto_verifies_are_chained_while_k_stays(path):
    """`mtp.k: auto` chains verifies while its choice stays the K of the one in flight (it chooses from the
    acceptance read so far); tokens as plain. tests/test_k_auto.py changes K between chained steps."""
    params = [SamplingParams(8, ignore_eos=True) for _ in PROMPTS]
    engine = make_engine(path, lookahead=True, k="auto")
    engine.warmup()
    assert summary(run(engine, params)) == summary(run(make_engine(path, lookahead=False), params))
    assert engine.lookahead_steps > 0
    assert_all_reclaimed(engine)


def test_k_auto_chains_under_random_arrivals_cancels_stops_and_k(path):
    """`mtp.k: auto` with K changing at random (K = 0 included) while requests arrive, are cancelled and stop on
    stop tokens, under memory pressure, oracle drafts accepted at 0.6: every finished request equals plain
    decoding with its parameters, nothing leaks, and chains ran at several K."""
    rng = random.Random(11)
    cache = {"num_pages": 24, "num_state_rows": 3, "max_batch": 3}
    reference = make_engine(path, False, **cache)
    engine = make_engine(path, True, k="auto", draft="oracle", **cache)
    engine.speculator.policy = RandomK(5)
    chained = chained_launches(engine)

    def submit(rng):
        prompt = random_prompt(rng.randint(1, 30), seed=rng.randint(0, 10**6))
        params = SamplingParams(rng.randint(1, 40), ignore_eos=True)
        expected = reference.generate([prompt], params)[0].token_ids
        if len(expected) > 3 and rng.random() < 0.3:  # stop at a token of its own continuation
            params = SamplingParams(params.max_new_tokens, ignore_eos=True, stop_token_ids=[expected[3]])
            expected = reference.generate([prompt], params)[0].token_ids
        return engine.submit_with_oracle(prompt, expected, params), expected

    submitted, cancelled = random_traffic(engine, rng, 150, 0.2, 0.03, submit)
    assert_all_reclaimed(engine)
    assert cancelled and len({k for k, _ in chained}) >= 3 and max(count for _, count in chained) > 1, chained
    for rid, expected in submitted.items():
        if rid not in cancelled:
            assert engine.result(rid).token_ids == expected, rid
