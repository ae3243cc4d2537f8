"""benchmarks/oracle_spread.py steps requests as the engine does: on the same oracle draws, its verify steps and
accepted drafts per request equal what the engine recorded, at every K (truncation at the last token included)."""

import pytest
from helpers import benchmark_module, cpu_engine, random_prompt, run_batch

from qwen_mtp import SamplingParams

spread = benchmark_module("oracle_spread")


@pytest.mark.parametrize("k", [1, 3, 4])
def test_steps_match_the_engine(checkpoint, k):
    path = checkpoint("tiny")
    prompts = [random_prompt(12 + 3 * i, seed=i) for i in range(4)]
    lengths = [9, 23, 40, 31]

    def params(i):
        return SamplingParams(max_new_tokens=lengths[i], ignore_eos=True)

    plain = [r.token_ids for r in run_batch(cpu_engine(path), params, prompts)]
    engine = cpu_engine(path, k, draft="oracle", oracle_accept=0.7)
    draws = {}
    start = engine.speculator.start

    def keep_draws(request, oracle=None):  # the engine's own draws, as it makes them
        start(request, oracle)
        draws[request.id] = list(engine.speculator._oracles[request.id][1])

    engine.speculator.start = keep_draws
    results = run_batch(engine, params, prompts, oracles=plain)
    assert [r.token_ids for r in results] == plain
    for i, result in enumerate(results):
        assert spread.request_steps(draws[i], k, lengths[i]) == (result.spec.verify_steps, result.spec.accepted)
    assert sum(r.spec.accepted for r in results) > 10  # the draws accepted runs, so stepping them was tested


def test_spread_centres_on_the_expectation_and_shrinks_with_length():
    short = spread.spread(4, 64, 0.8, [3, 4], {3: 17.0, 4: 19.0}, trials=400, miss=0.03)
    long = spread.spread(4, 512, 0.8, [3, 4], {3: 17.0, 4: 19.0}, trials=400, miss=0.03)
    for k, expected in ((3, 2.952), (4, 3.3616)):
        assert abs(long["lengths"][k]["mean"] - expected) < 0.02
        width = {r["output_len"]: r["lengths"][k]["p95"] - r["lengths"][k]["p5"] for r in (short, long)}
        assert width[512] < width[64] / 2
    assert short["chosen"] == 4  # 3.36 / 19 > 2.95 / 17
    assert long["tpot"]["p_miss"] <= short["tpot"]["p_miss"]
