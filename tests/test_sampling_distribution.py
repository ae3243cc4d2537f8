"""Sampling: the engine's sampler draws from softmax(logits / T) after top-k / top-p / min-p (a chi-square test
over 20,000 seeds, zero mass outside the kept set); seeds replay and differ; a request's tokens never depend on
what shares its step (greedy ones stay the argmax); logprobs equal log_softmax of our own logits."""

import pytest
import torch
from helpers import random_prompt

from qwen_mtp import Engine, SamplingParams, load_model
from qwen_mtp.engine import sampling

SEEDS = 20_000


def make_engine(path, **cache):
    recipe = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "cache": cache}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.fixture(scope="module")
def first_logits(tmp_path_factory):
    """The tiny model's logits for the token after a prompt, computed once."""
    from qwen_mtp.testing import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")
    with torch.inference_mode():
        return load_model(path, dtype=torch.float32)(torch.tensor([random_prompt(12, seed=5)]))[0, -1]


def kept_distribution(logits, temperature, top_k, top_p, min_p):
    """softmax(logits / T) filtered and renormalised, in float64, from the definitions: top-k, then the smallest
    prefix of the top-k whose renormalised mass reaches top_p, then p >= min_p * p_max."""
    probs = torch.softmax(logits.double() / temperature, dim=0)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = top_k or len(probs)
    inside = probs[order[:k]] / probs[order[:k]].sum()
    before = torch.cumsum(inside, dim=0) - inside
    keep[order[:k][before < top_p]] = True
    keep &= probs >= min_p * probs.max()
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def chi_square_p_value(counts, expected):
    """Pearson's test, bins with expected counts under 5 pooled into one."""
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expect = torch.cat([expected[big], expected[~big].sum()[None]])
    if expect[-1] < 5:  # too little mass to pool: fold it into the last big bin
        observed, expect = observed[:-1].clone(), expect[:-1].clone()
        observed[-1] += counts[~big].sum()
        expect[-1] += expected[~big].sum()
    statistic = ((observed - expect) ** 2 / expect).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0)), dof


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(0.7, 40, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (0.7, 100, 0.8, 0.05), (1.3, 0, 1.0, 0.0)],
)
def test_samples_follow_the_filtered_softmax(first_logits, temperature, top_k, top_p, min_p):
    """The engine's `sampling.choose`, vectorized over 20,000 seeds at one position, against the distribution."""
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=s) for s in range(SEEDS)
    ]
    rows = sampling.rows_of(params, lambda values, dtype: torch.tensor(values, dtype=dtype))
    logits = first_logits[None].expand(SEEDS, -1)
    tokens, _ = sampling.choose(logits, rows.mode, torch.full((SEEDS,), 12), **rows.tensors)
    expected = kept_distribution(first_logits, temperature, top_k, top_p, min_p)
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    assert counts[expected == 0].sum() == 0  # nothing outside the kept set
    p_value, dof = chi_square_p_value(counts, expected * SEEDS)
    assert dof >= 10 and p_value > 0.001, (p_value, dof)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from qwen_mtp.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")


def sampled(seed=None, **changes):
    return SamplingParams(**{"max_new_tokens": 10, "ignore_eos": True, "temperature": 0.8, "seed": seed, **changes})


def test_same_seed_same_tokens_different_seeds_different(path):
    prompt = random_prompt(9, seed=1)
    engine = make_engine(path)
    first = engine.generate([prompt], sampled(seed=7))[0]
    assert first.seed == 7
    assert make_engine(path).generate([prompt], sampled(seed=7))[0].token_ids == first.token_ids
    others = [engine.generate([prompt], sampled(seed=s))[0].token_ids for s in (8, 9, 10)]
    assert all(tokens != first.token_ids for tokens in others)
    drawn = engine.generate([prompt, prompt], sampled())  # seeds drawn at submit, recorded, replayable
    assert drawn[0].seed is not None and drawn[0].seed != drawn[1].seed
    assert make_engine(path).generate([prompt], sampled(seed=drawn[1].seed))[0].token_ids == drawn[1].token_ids


def test_tokens_do_not_depend_on_the_batch_or_its_sampler_mode(path):
    """Greedy requests stay the argmax beside sampled ones; a sampled request without filters gets the same
    tokens alone (no sort in its step) as beside one with top-p (its step sorts) or asking logprobs."""
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 30)]
    engine = make_engine(path)
    greedy = [r.token_ids for r in engine.generate(prompts, max_new_tokens=10, ignore_eos=True)]
    plain = engine.generate([prompts[1]], sampled(seed=3))[0].token_ids
    ids = [
        engine.submit(prompts[0], SamplingParams(10, ignore_eos=True)),
        engine.submit(prompts[1], sampled(seed=3)),
        engine.submit(prompts[2], sampled(seed=4, top_p=0.9, top_k=20, logprobs=2)),
    ]
    while engine.has_unfinished():
        engine.step()
    results = [engine.result(i) for i in ids]
    assert results[0].token_ids == greedy[0] and results[1].token_ids == plain
    assert (
        results[2].token_ids
        == make_engine(path).generate([prompts[2]], sampled(seed=4, top_p=0.9, top_k=20))[0].token_ids
    )


def test_logprobs_equal_log_softmax_of_our_logits(path):
    prompt = random_prompt(21, seed=2)
    engine = make_engine(path, prefill_chunk=8)  # prompt logprobs over three chunks
    result = engine.generate([prompt], sampled(seed=5, top_p=0.9, logprobs=4, prompt_logprobs=3))[0]
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + result.token_ids]))[0]
    reference = torch.log_softmax(logits.float(), dim=-1)  # position i predicts token i + 1
    assert len(result.logprobs) == len(result.token_ids) and len(result.prompt_logprobs) == len(prompt)
    assert result.prompt_logprobs[0] is None
    entries = [(i, e) for i, e in enumerate(result.prompt_logprobs) if e is not None]
    entries += [(len(prompt) + i, e) for i, e in enumerate(result.logprobs)]
    sequence = prompt + result.token_ids
    for index, entry in entries:
        row = reference[index - 1]
        assert entry.token_id == sequence[index]
        assert entry.logprob == pytest.approx(float(row[sequence[index]]), abs=1e-4)
        n = 3 if index < len(prompt) else 4
        top = row.topk(n)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert engine.generate([prompt], sampled(seed=5))[0].logprobs is None
