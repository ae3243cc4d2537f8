"""`compile.prefill_graphs` on the GPU: full prefill chunks replayed from CUDA graphs give the tokens the eager
chunks give (plain and MTP K=2, unpacked and in mixed steps; prompts of several full chunks, a partial last chunk,
and shorter than one), and the graphs were captured."""

import pytest
from helpers import random_prompt

from qwen_mtp import Engine


def engine_for(prefill_graphs, k=None, mixed=False):
    cache = {"max_batch": 8, "num_state_rows": 8, "num_pages": 400, "prefill_chunk": 512, "mixed_steps": mixed}
    recipe = {
        "model": {"synthetic": "qwen3.5-0.8b", "dtype": "bfloat16", "device": "cuda"},
        "cache": cache,
        "compile": {"cuda_graphs": True, "prefill_graphs": prefill_graphs},
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": "oracle", "oracle_accept": 0.7}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("mixed", [False, True], ids=["unpacked", "mixed"])
@pytest.mark.parametrize("k", [None, 2], ids=["plain", "k2"])
def test_graphed_full_chunks_give_the_eager_tokens(k, mixed):
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (512, 1500, 7, 2048, 1024, 600, 1, 513)]
    alone = random_prompt(1100, seed=1, vocab=200000)  # a step of its own for its first chunk (mixed steps)

    def run(engine):
        got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=24, ignore_eos=True)]
        return got + [engine.generate([alone], max_new_tokens=24, ignore_eos=True)[0].token_ids]

    expected = run(engine_for(False, k, mixed))
    graphed = engine_for(True, k, mixed)
    assert run(graphed) == expected
    steps = graphed.runner.chunk_graphs._steps
    kinds = {"packed-first", "packed-next"} if mixed else {"first", "next"}
    assert set(steps) == (kinds | {"mtp"} if k else kinds)
    assert all(step.graph is not None for step in steps.values())
