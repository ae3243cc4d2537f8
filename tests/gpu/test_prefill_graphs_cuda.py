"""`compile.prefill_graphs` on the GPU: full prefill chunks replayed from CUDA graphs give the tokens the eager
chunks give (plain and MTP K=2, prompts of several full chunks, a partial last chunk, and shorter than one), and
the graphs were captured."""

import pytest
from helpers import random_prompt

from qwen_mtp import Engine


def engine_for(prefill_graphs, k=None):
    recipe = {
        "model": {"synthetic": "qwen3.5-0.8b", "dtype": "bfloat16", "device": "cuda"},
        "cache": {"max_batch": 8, "num_state_rows": 8, "num_pages": 400, "prefill_chunk": 512},
        "compile": {"cuda_graphs": True, "prefill_graphs": prefill_graphs},
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": "oracle", "oracle_accept": 0.7}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("k", [None, 2], ids=["plain", "k2"])
def test_graphed_full_chunks_give_the_eager_tokens(k):
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (512, 1500, 7, 2048, 1024, 600, 1, 513)]
    expected = [r.token_ids for r in engine_for(False, k).generate(prompts, max_new_tokens=24, ignore_eos=True)]
    graphed = engine_for(True, k)
    assert [r.token_ids for r in graphed.generate(prompts, max_new_tokens=24, ignore_eos=True)] == expected
    steps = graphed.runner.chunk_graphs._steps
    assert set(steps) == ({"first", "next", "mtp"} if k else {"first", "next"})
    assert all(step.graph is not None for step in steps.values())
