"""A request's numbers do not depend on its batch, bit for bit: the logprobs (chosen token and top-n, prompt
logprobs too) of every request equal those of MTP-off decoding alone, with MTP off at batch 8 and with MTP on
(K = 2, 3: verify steps of K + 1 tokens per request) at batch 8, greedy and sampled requests mixed, fp32 and bf16.
Equal tokens are not enough: a row computed in another order moves logprobs by an ulp long before it flips a
token (the CPU reference ops: rowwise products, every elementwise function through one code path)."""

import functools

import pytest
from helpers import random_prompt

from qwen_mtp import Engine, SamplingParams

MAX_NEW = 12
LENGTHS = (1, 5, 33, 2, 19, 4, 9, 17)  # mixed, chunked prefill at 16 tokens (33 and 19 mix prefill with decode)
PROMPTS = [random_prompt(n, seed=300 + n) for n in LENGTHS]


def make_engine(path, dtype, k=None):
    recipe = {"model": {"path": str(path), "dtype": dtype, "device": "cpu"}, "cache": {"prefill_chunk": 16}}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k}
    return Engine.from_recipe(recipe, log=lambda _: None)


def params(i):
    """Even requests greedy, odd ones sampled with their own seed; all ask for logprobs and prompt logprobs."""
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 7 * i + 1} if i % 2 else {}
    return SamplingParams(MAX_NEW, ignore_eos=True, logprobs=4, prompt_logprobs=2, **sampled)


def numbers(result):
    """Everything a request returns, floats as they are (compared with ==, never approximately)."""
    entries = [None if e is None else (e.token_id, e.logprob, tuple(e.top)) for e in result.prompt_logprobs]
    return result.token_ids, entries, [(e.token_id, e.logprob, tuple(e.top)) for e in result.logprobs]


def run(engine, indices):
    ids = {i: engine.submit(PROMPTS[i], params(i)) for i in indices}
    while engine.has_unfinished():
        engine.step()
    return {i: numbers(engine.result(r)) for i, r in ids.items()}


@functools.cache
def alone(path, dtype):
    """MTP off, each request by itself: the numbers every batch must reproduce."""
    engine = make_engine(path, dtype)
    return {i: run(engine, [i])[i] for i in range(len(PROMPTS))}


def assert_same_numbers(got, expected, what):
    for i in expected:
        tokens, prompt, output = got[i]
        want_tokens, want_prompt, want_output = expected[i]
        assert prompt == want_prompt, f"{what}, request {i}: prompt logprobs differ from the request alone"
        first = next((j for j, (a, b) in enumerate(zip(output, want_output, strict=True)) if a != b), None)
        assert first is None, (
            f"{what}, request {i} ({len(PROMPTS[i])} prompt tokens): output position {first} differs from MTP-off "
            f"alone: {output[first]} != {want_output[first]}"
        )
        assert tokens == want_tokens


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [("tiny", "float32"), ("tiny", "bfloat16"), ("tiny-8l", "bfloat16"), ("tiny-moe", "float32")],
)
@pytest.mark.parametrize("k", [None, 2, 3])
def test_logprobs_at_batch8_equal_mtp_off_alone_bitwise(checkpoint, preset, dtype, k):
    path = checkpoint(preset)
    expected = alone(path, dtype)
    engine = make_engine(path, dtype, k)
    assert_same_numbers(run(engine, range(len(PROMPTS))), expected, f"batch 8, MTP K={k}")
    if k is not None:
        assert engine.stats()["verify_steps"] > 0
