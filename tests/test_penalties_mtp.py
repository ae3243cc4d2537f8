"""Logit bias, repetition, presence and frequency penalties, min_tokens: greedy `repetition_penalty`, `logit_bias`
and `min_tokens` give Hugging Face's `generate(repetition_penalty=...)` / `(sequence_bias=...)` /
`(min_new_tokens=...)` tokens; presence and frequency
penalties give what a reference loop over full forwards gives (its own counts and its own float32 arithmetic); MTP
on (K = 1..4 with oracle and head drafts, K per step including K = 0, lookahead) emits exactly MTP-off's tokens, for
penalized requests batched with unpenalized, sampled and logprob ones, and alone. Logprobs stay those of the
unpenalized distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cpu_engine, load_hf, random_prompt, run_batch

from qwen_mtp import Engine, SamplingParams
from qwen_mtp.errors import RequestError

MAX_NEW = 20
# prompts that repeat tokens (a repetition penalty sees them) and plain random ones
PROMPTS = [random_prompt(n, seed=900 + n) for n in (1, 6, 33, 3, 19, 9, 17, 4, 12, 2, 7, 5)]
PROMPTS[1] = PROMPTS[1] * 3


def mixed(i: int) -> SamplingParams:
    """Request i's parameters: penalized greedy and sampled requests beside unpenalized ones, one with logprobs;
    a negative frequency penalty (repeat!) makes the next tokens hang on the exact counts."""
    base = {"max_new_tokens": MAX_NEW, "ignore_eos": True}
    kinds = [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.9, "frequency_penalty": 1.7},
        {},
        {"frequency_penalty": -1.2, "logit_bias": {17: 4.0, 300: -100.0}},
        {"temperature": 0.8, "top_p": 0.9, "seed": 13, "presence_penalty": 1.1, "repetition_penalty": 0.8},
        {"logit_bias": {5: 2.5, 6: 3.0}},
        {"temperature": 0.7, "seed": 16, "logit_bias": {9: 3.0}, "frequency_penalty": 0.6},
        {"temperature": 0.9, "seed": 14},
        {"repetition_penalty": 1.6, "frequency_penalty": 0.4, "logprobs": 2},
        {"frequency_penalty": 2.0, "top_k": 5, "temperature": 1.0, "seed": 15},
        # min_tokens against a stop token the bias makes the favourite: it ends the request right after them
        {"min_tokens": 6, "stop_token_ids": (77,), "logit_bias": {77: 50.0}},
        # the same, sampled through the filters (-inf logits in the threshold), the stop token merely likely
        {
            "temperature": 0.9,
            "top_p": 0.8,
            "seed": 17,
            "min_tokens": 4,
            "stop_token_ids": (78,),
            "logit_bias": {78: 4.0},
        },
    ]
    return SamplingParams(**base, **kinds[i % len(kinds)])


def run(engine: Engine, params, prompts=PROMPTS, oracles=None) -> list:
    """Every prompt with params(i), as one continuous batch: (tokens, logprobs) per request."""
    return [(r.token_ids, r.logprobs) for r in run_batch(engine, params, prompts, oracles)]


def tokens_of(results) -> list[list[int]]:
    return [tokens for tokens, _ in results]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint()


@pytest.fixture(scope="module")
def plain(path):
    """MTP off, the whole batch at once."""
    return run(cpu_engine(path), mixed)


# ---- parameters ----------------------------------------------------------------------------------------------
def test_bad_penalties_are_request_errors():
    bad_values = [{"repetition_penalty": 0.0}, {"repetition_penalty": -1.0}, {"presence_penalty": 2.5}]
    bad_values += [{"frequency_penalty": -3.0}, {"frequency_penalty": float("nan")}, {"presence_penalty": "1"}]
    for bad in bad_values:
        with pytest.raises(RequestError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.1).penalized
    with pytest.raises(RequestError, match="min_tokens must be an integer in \\[0, max_new_tokens\\]"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
    assert SamplingParams(min_tokens=1).penalized
    positional = SamplingParams(8, True, (3,), 0.5)  # the fields before these keep their places
    assert (positional.ignore_eos, positional.stop_token_ids, positional.temperature) == (True, (3,), 0.5)
    for bad, message in (({3: 101.0}, "in \\[-100, 100\\]"), ({-1: 1.0}, "token ids"), ({"3": 1.0}, "token ids"),
                         ([(3, 1.0), (3, 2.0)], "twice"), ("3:1", "map token ids")):  # fmt: skip
        with pytest.raises(RequestError, match=message):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={7: 1, 2: -3.5}).logit_bias == ((2, -3.5), (7, 1.0))
    assert SamplingParams(logit_bias={7: 0.0}).penalized is False


def test_logit_bias_outside_the_vocabulary_is_refused_at_submit(path):
    engine = cpu_engine(path)
    with pytest.raises(RequestError, match="logit_bias names token ids outside the vocabulary"):
        engine.submit([1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0


# ---- against references -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [1.3, 0.75])
def test_repetition_penalty_matches_hf(path, penalty):
    hf = load_hf(path, torch.float32)
    engine = cpu_engine(path)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=penalty)
    results = engine.generate(PROMPTS[:4], params)
    for prompt, result in zip(PROMPTS[:4], results, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                          repetition_penalty=penalty, pad_token_id=0, eos_token_id=None)  # fmt: skip
        assert result.token_ids == out[0, len(prompt) :].tolist()
    unpenalized = engine.generate(PROMPTS[:4], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert [r.token_ids for r in results] != [r.token_ids for r in unpenalized]


def test_logit_bias_matches_hf_and_bans_and_forces(path):
    hf = load_hf(path, torch.float32)
    engine = cpu_engine(path)
    free = engine.generate(PROMPTS[:4], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for prompt, unbiased in zip(PROMPTS[:4], free, strict=True):
        bias = {unbiased.token_ids[0]: -100.0, unbiased.token_ids[3]: -2.0, 11: 3.5}
        params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logit_bias=bias)
        (result,) = engine.generate([prompt], params)
        ids = torch.tensor([prompt])
        sequence_bias = [[[token], value] for token, value in bias.items()]
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                          sequence_bias=sequence_bias, pad_token_id=0, eos_token_id=None)  # fmt: skip
        assert result.token_ids == out[0, len(prompt) :].tolist()
        assert unbiased.token_ids[0] not in result.token_ids  # banned
    (forced,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias={42: 100}))
    assert forced.token_ids == [42] * 8


def test_min_tokens_matches_hf_and_holds_back_every_stop(path):
    """EOS (the model's own third greedy token, declared EOS), stop token ids and stop strings end nothing among the
    first min_tokens tokens; greedy tokens equal HF's `generate(min_new_tokens=...)`."""
    hf = load_hf(path, torch.float32)
    engine = cpu_engine(path)
    prompt = PROMPTS[2]
    (free,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop = free.token_ids[2]
    engine.eos_ids = {stop}
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, min_tokens=5))
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, min_new_tokens=5,
                      eos_token_id=[stop], pad_token_id=stop)  # fmt: skip
    expected = out[0, len(prompt) :].tolist()
    expected = expected[: expected.index(stop) + 1] if stop in expected else expected
    assert result.token_ids == expected and stop not in result.token_ids[:5]
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,), min_tokens=5)
    assert engine.generate([prompt], plain)[0].token_ids == result.token_ids
    (early,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,)))
    assert early.token_ids == free.token_ids[:3] and early.finish_reason == "stop"


def test_min_tokens_ends_the_request_right_after_them_with_mtp_on(path, plain):
    """The last kind of `mixed`: a stop token biased to be every position's favourite is banned for 6 tokens, so the
    request ends with it as token 7, also when a verify's positions straddle the boundary."""
    tokens, _ = plain[10]
    assert len(tokens) == 7 and tokens[-1] == 77 and 77 not in tokens[:6]
    engine = cpu_engine(path, 4, draft="oracle", oracle_accept=1.0)
    ids = [engine.submit_with_oracle(PROMPTS[10], tokens, mixed(10))]
    while engine.has_unfinished():
        engine.step()
    result = engine.result(ids[0])
    assert result.token_ids == tokens and result.finish_reason == "stop"


@torch.inference_mode()
def test_presence_and_frequency_match_a_reference_loop(path):
    """Each token from a full forward over prompt + output so far, penalized with counts the loop keeps itself."""
    hf = load_hf(path, torch.float32)
    engine = cpu_engine(path)
    f32 = np.float32
    for prompt, (presence, frequency) in zip(PROMPTS[:3], [(0.9, 1.7), (0.0, -1.2), (1.5, 0.0)], strict=True):
        params = SamplingParams(MAX_NEW, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
        (result,) = engine.generate([prompt], params)
        tokens, counts = list(prompt), {}
        for _ in range(MAX_NEW):
            logits = hf(torch.tensor([tokens])).logits[0, -1].float().numpy().copy()
            for token, c in counts.items():
                logits[token] = f32(f32(logits[token] - f32(frequency) * f32(c)) - f32(presence))
            token = int(np.argmax(logits))
            counts[token] = counts.get(token, 0) + 1
            tokens.append(token)
        assert result.token_ids == tokens[len(prompt) :]


# ---- MTP on == MTP off --------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_penalized_mtp_equals_plain_batched_and_alone(path, plain, k):
    engine = cpu_engine(path, k, draft="oracle", oracle_accept=0.8)
    assert run(engine, mixed, oracles=tokens_of(plain)) == plain
    assert engine.stats()["acceptance_length"] > 1 + k / 2  # drafts accepted: the verify's draft counts mattered
    for i in (1, 3, 4, 9):  # alone
        alone = run(engine, lambda _, i=i: mixed(i), [PROMPTS[i]], [plain[i][0]])
        assert alone == [plain[i]]


def test_penalized_mtp_with_head_drafts_equals_plain(path, plain):
    engine = cpu_engine(path, 3)
    assert run(engine, mixed) == plain


def test_penalties_change_the_tokens_and_keep_unpenalized_logprobs(path, plain):
    """The penalized requests differ from their unpenalized selves, the unpenalized ones beside them do not, and a
    penalized request's logprobs are those of the model's own distribution at the tokens it chose."""
    free = run(cpu_engine(path), lambda i: SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=2))
    assert tokens_of(plain)[2] == tokens_of(free)[2]
    assert tokens_of(plain)[0] != tokens_of(free)[0] and tokens_of(plain)[3] != tokens_of(free)[3]
    tokens, logprobs = plain[8]
    hf = load_hf(path, torch.float32)
    with torch.inference_mode():
        full = hf(torch.tensor([PROMPTS[8] + tokens])).logits[0, len(PROMPTS[8]) - 1 : -1].float()
    expected = torch.log_softmax(full, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([entry.logprob for entry in logprobs]), expected, atol=1e-5)


def test_penalized_k_per_step_and_lookahead_equal_plain(path, plain):
    """K changing every step (K = 0 plain steps and filler drafts included), and verify steps launched ahead of the
    previous one's read-back (its counts still on the device)."""
    from test_k_auto import Scripted

    engine = cpu_engine(path, "auto", max_k=3, draft="oracle", oracle_accept=0.8)
    engine.speculator.policy = Scripted([3, 1, 0, 2, 0, 3])
    assert run(engine, mixed, oracles=tokens_of(plain)) == plain
    recipe = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"},
              "cache": {"prefill_chunk": 16, "lookahead": True},
              "mtp": {"enabled": True, "k": 2, "draft": "oracle", "oracle_accept": 0.8}}  # fmt: skip
    ahead = Engine.from_recipe(recipe, log=lambda _: None)
    assert run(ahead, mixed, oracles=tokens_of(plain)) == plain
    assert ahead.lookahead_steps > 0
    plain_ahead = Engine.from_recipe({**recipe, "mtp": {"enabled": False}}, log=lambda _: None)
    assert run(plain_ahead, mixed) == plain and plain_ahead.lookahead_steps > 0


SHIPPED = Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small"


def test_drafts_guess_the_penalized_choice_on_the_trained_model():
    """Coupled drafts (the default) score with the request's penalties and the chain's earlier drafts counted, as the
    target will: on the shipped trained checkpoint at repetition_penalty 1.3 they are accepted more often than the
    head's unpenalized argmax (`mtp.coupled_drafts: false`), and the tokens are MTP-off's either way."""
    recipe = {"model": {"path": str(SHIPPED), "dtype": "float32", "device": "cpu"}}
    coupled = {"penalized": True, "plain": False}
    mtp = {name: {"enabled": True, "k": 3, "coupled_drafts": value} for name, value in coupled.items()}
    engines = {name: Engine.from_recipe(recipe | {"mtp": section}, log=lambda _: None) for name, section in mtp.items()}
    prompts = [engines["plain"].encode(t) for t in ("def parse_args(argv):\n", "import os\nimport sys\n\n")]
    params = SamplingParams(64, ignore_eos=True, repetition_penalty=1.3)
    expected = [r.token_ids for r in Engine.from_recipe(recipe, log=lambda _: None).generate(prompts, params)]
    for engine in engines.values():
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    lengths = {name: engine.stats()["acceptance_length"] for name, engine in engines.items()}
    assert lengths["penalized"] > lengths["plain"] + 0.1, lengths


@pytest.mark.parametrize("k", [None, 2])
def test_a_state_row_s_next_request_does_not_inherit_its_logit_bias(path, k):
    """Penalties live by state row, and a request without any is never `start`ed on its row: its neutral penalties
    must ignore whatever the row's last request left there. Two requests that force token 7 (bias +100) fill both
    state rows and finish; then an unpenalized request decodes beside a penalized one on those rows. It must get
    its tokens alone, MTP off and on."""
    engine = Engine.from_recipe(
        {"model": {"path": str(path), "dtype": "float32", "device": "cpu"},
         "cache": {"prefill_chunk": 16, "max_batch": 2, "num_state_rows": 2},
         **({"mtp": {"enabled": True, "k": k}} if k else {})},
        log=lambda _: None,
    )  # fmt: skip
    forced = SamplingParams(max_new_tokens=3, ignore_eos=True, logit_bias={7: 100.0}, min_tokens=2)
    assert all(r.token_ids == [7, 7, 7] for r in engine.generate(PROMPTS[:2], forced))
    free = SamplingParams(MAX_NEW, ignore_eos=True)
    unbiased = engine.submit(PROMPTS[2], free)
    engine.submit(PROMPTS[3], SamplingParams(MAX_NEW, ignore_eos=True, repetition_penalty=1.3))
    while engine.has_unfinished():
        engine.step()
    alone = cpu_engine(path).generate([PROMPTS[2]], free)[0].token_ids
    assert 7 not in alone
    assert engine.result(unbiased).token_ids == alone
