"""Device->host synchronisations per engine step on CUDA. An MTP step (verify -> accept -> commit -> catch-up and
draft chain) and a plain decode step wait for the device once, for the copy of its tokens to the host, under CUDA
graphs (the default) and eagerly, with and without the lookahead: counted by a counter around
`Runner.start_read` (one copy a step) and by torch's sync debug mode, which must see nothing else."""

import warnings

import pytest
import torch
from helpers import random_prompt

from qwen_mtp import Engine, SamplingParams

STEPS = 8


def make_engine(k, draft, graphs, lookahead=False):
    recipe = {
        "model": {"fixture": "tiny-8l", "dtype": "bfloat16", "device": "cuda"},
        "cache": {"max_batch": 4, "num_state_rows": 4, "num_pages": 64, "lookahead": lookahead},
        "compile": {"cuda_graphs": graphs},
    }
    if k:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": 0.7}
    return Engine.from_recipe(recipe, log=lambda _: None)


def synchronisations(engine, steps):
    """(where each synchronising CUDA call came from, copies of results to the host) over `steps` engine steps."""
    reads, start_read = [], engine.runner.start_read

    def counted(parts):
        reads.append(len(parts))
        return start_read(parts)

    engine.runner.start_read = counted
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.runner.start_read = start_read
    # (setting the mode warns once per process that it is experimental: not a synchronisation)
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    return [f"{w.filename}:{w.lineno}" for w in syncs], len(reads)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize(
    "k,draft,lookahead", [(0, "-", False), (0, "-", True), (2, "oracle", False), (4, "head", False)]
)
def test_one_synchronisation_per_step(k, draft, lookahead, graphs):
    engine = make_engine(k, draft, graphs, lookahead)
    plain = make_engine(0, "-", graphs)
    prompts = [random_prompt(n, seed=n) for n in (3, 40, 9, 17)]
    params = SamplingParams(6 * STEPS, ignore_eos=True)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    if draft == "oracle":
        ids = [engine.submit_with_oracle(p, o, params) for p, o in zip(prompts, expected, strict=True)]
    else:
        ids = [engine.submit(p, params) for p in prompts]
    while any(engine.requests[i].in_prefill or engine.requests[i].num_output < 2 for i in ids):
        engine.step()  # prefill, and the first decode or verify step (captures the graphs)
    chained = engine.lookahead_steps
    syncs, reads = synchronisations(engine, STEPS)
    assert not any(engine.requests[i].done for i in ids)  # every counted step decoded all four requests
    # the wait for a step's copy is an event's (the lookahead runs on meanwhile): the debug mode may count it
    # (a synchronisation) or not, but nothing else
    assert reads == STEPS and len(syncs) <= STEPS and all("runner.py" in where for where in syncs), syncs
    assert engine.lookahead_steps - chained == (STEPS if lookahead else 0)
    while engine.has_unfinished():
        engine.step()
    assert [engine.result(i).token_ids for i in ids] == expected
