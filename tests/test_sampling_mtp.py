"""Sampled MTP speculation is lossless: with T = 0.8 and top_p = 0.95, MTP K = 1..4 (coupled head drafts, greedy
drafts, oracle drafts) emits exactly MTP-off's tokens for every request, at batch 1 and 8 with mixed prompt
lengths, through cancellations and re-admissions; stop strings cut at the same token with MTP on and off, also
inside a verify's accepted drafts."""

import functools

import pytest
from helpers import random_prompt

from qwen_mtp import Engine, SamplingParams

MAX_NEW = 12
LENGTHS = (1, 5, 33, 2, 19, 4, 9, 17)  # mixed, chunked prefill at 16 tokens


def make_engine(path, k=None, **mtp):
    recipe = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "cache": {"prefill_chunk": 16}}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, **mtp}
    return Engine.from_recipe(recipe, log=lambda _: None)


def params(seed, **changes):
    values = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0.8, "top_p": 0.95, "seed": seed}
    return SamplingParams(**(values | changes))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from qwen_mtp.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")


def run(engine, prompts, seeds):
    """Every prompt with its own seed, as one continuous batch; tokens in prompt order."""
    ids = [engine.submit(p, params(s)) for p, s in zip(prompts, seeds, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [engine.result(i).token_ids for i in ids]


PROMPTS = [random_prompt(n, seed=200 + n) for n in LENGTHS]
SEEDS = [11 * i + 3 for i in range(len(PROMPTS))]


@functools.cache
def plain(path):
    return run(make_engine(path), PROMPTS, SEEDS)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_sampled_mtp_equals_plain_batch8_and_batch1(path, k):
    expected = plain(path)
    engine = make_engine(path, k)
    assert run(engine, PROMPTS, SEEDS) == expected  # batch 8
    assert [run(engine, [p], [s])[0] for p, s in zip(PROMPTS[:2], SEEDS[:2], strict=True)] == expected[:2]
    stats = engine.stats()
    assert stats["verify_steps"] > 0 and stats["free_pages"] == stats["total_pages"]
    if k == 3:
        # greedy drafts (mtp.coupled_drafts: false): the same tokens, accepted less often than coupled drafts
        # (on this random tiny model the head's argmax is rarely the sampled token)
        greedy_drafts = make_engine(path, k, coupled_drafts=False)
        assert run(greedy_drafts, PROMPTS, SEEDS) == expected
        assert greedy_drafts.stats()["acceptance_length"] < stats["acceptance_length"]


def test_sampled_mtp_through_cancellations_and_readmissions(path):
    """Requests cancelled mid-prefill and mid-decode and submitted again, beside others, end with the tokens MTP-off
    gives each alone: a token depends only on its request's seed and position."""
    expected = plain(path)
    engine = make_engine(path, 3, draft="oracle", oracle_accept=0.6)
    oracle = dict(enumerate(expected))
    ids = {i: engine.submit_with_oracle(PROMPTS[i], oracle[i], params(SEEDS[i])) for i in (2, 5, 6, 7)}
    for _ in range(2):
        engine.step()
    assert engine.requests[ids[2]].in_prefill and engine.requests[ids[6]].num_output > 0
    for i in (2, 6):
        engine.cancel(ids[i])
        assert engine.result(ids[i]).finish_reason == "cancelled"
    engine.step()
    for i in (2, 6, 0):
        ids[i] = engine.submit_with_oracle(PROMPTS[i], oracle[i], params(SEEDS[i]))
    while engine.has_unfinished():
        engine.step()
    assert {i: engine.result(r).token_ids for i, r in ids.items()} == {i: expected[i] for i in ids}
    assert engine.stats()["acceptance_length"] > 1.3


def stop_after(engine, prompt, seed, first=4):
    """A stop string that the output's text first contains after token i >= first, and i."""
    tokens = engine.generate([prompt], params(seed, max_new_tokens=16))[0].token_ids
    for i in range(first, len(tokens)):
        before, text = engine.decode(tokens[:i]), engine.decode(tokens[: i + 1])
        candidate = text[-2:]
        if len(candidate.strip()) == 2 and "\ufffd" not in candidate and candidate not in before:
            return candidate, i, tokens
    raise AssertionError("no usable stop string in this output")


@pytest.mark.parametrize("k", [2, 4])
def test_stop_strings_cut_identically_with_mtp_on_and_off(path, k):
    off = make_engine(path)
    prompt, seed = PROMPTS[3], 5
    stop, index, full = stop_after(off, prompt, seed)
    expected = off.generate([prompt], params(seed, max_new_tokens=16, stop=stop))[0]
    assert expected.finish_reason == "stop" and expected.token_ids == full[: index + 1]
    text = off.decode(full[: index + 1])
    assert expected.text == text[: text.find(stop)] and stop not in expected.text
    # oracle drafts accepted every time: the stop lands inside a verify's accepted tokens
    on = make_engine(path, k, draft="oracle", oracle_accept=1.0)
    got = on.generate([prompt], params(seed, max_new_tokens=16, stop=stop))[0]
    assert (got.token_ids, got.finish_reason, got.text) == (expected.token_ids, "stop", expected.text)
    assert max(got.spec.accept_lengths) == k + 1
    assert on.stats()["free_pages"] == on.stats()["total_pages"]
