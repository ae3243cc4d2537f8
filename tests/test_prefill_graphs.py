"""Full prefill chunks on static inputs (`compile.prefill_graphs`): on CUDA they replay a captured graph; here on
CPU the same static buffers feed the step functions directly. A chunk's numbers must not depend on it: the same
tokens as without, for prompts of several full chunks and a partial last one, plain and with MTP, in fp32 and
bf16, and the static steps must be the ones that ran."""

import pytest
import torch
from helpers import random_prompt

from qwen_mtp import Engine
from qwen_mtp.engine.engine import prefill_graphs_on
from qwen_mtp.errors import RecipeError
from qwen_mtp.recipe import CompileSection, load_recipe

CHUNK = 16


def make_engine(path, dtype, prefill_graphs, k=None, **cache):
    recipe = {
        "model": {"path": str(path), "dtype": dtype, "device": "cpu"},
        "cache": {"max_batch": 4, "prefill_chunk": CHUNK, **cache},
        "compile": {"cuda_graphs": False, "prefill_graphs": prefill_graphs},
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [None, 2])
def test_static_full_chunks_give_the_same_tokens(checkpoint, dtype, k):
    path = checkpoint("tiny", dtype=dtype)
    prompts = [random_prompt(n, seed=700 + n) for n in (CHUNK, 3 * CHUNK + 5, 7, 2 * CHUNK)]
    expected = [r.token_ids for r in make_engine(path, dtype, False, k).generate(prompts, max_new_tokens=8)]
    engine = make_engine(path, dtype, True, k)
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=8)] == expected
    ran = set(engine.runner.chunk_graphs._steps)
    assert ran == ({"first", "next", "mtp"} if k else {"first", "next"})
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"]


@pytest.mark.parametrize("k", [None, 2])
def test_packed_steps_of_one_full_chunk_give_the_same_tokens(checkpoint, k):
    """Mixed steps: a packed step that holds a single full chunk runs its static step (the packed forward's
    own, not the unpacked one); steps packing several chunks stay eager. Same tokens either way."""
    path = checkpoint("tiny")
    batch = [random_prompt(n, seed=800 + n) for n in (CHUNK, 3 * CHUNK + 5, 7, 2 * CHUNK)]
    alone = random_prompt(2 * CHUNK + 3, seed=899)  # its first chunk is a step's only one

    def run(engine):
        return [r.token_ids for r in engine.generate(batch, max_new_tokens=8)] + [
            engine.generate([alone], max_new_tokens=8)[0].token_ids
        ]

    expected = run(make_engine(path, "float32", False, k, mixed_steps=True))
    engine = make_engine(path, "float32", True, k, mixed_steps=True)
    assert run(engine) == expected
    assert {"packed-first", "packed-next"} <= set(engine.runner.chunk_graphs._steps)
    assert not {"first", "next"} & set(engine.runner.chunk_graphs._steps)  # every chunk went through the packed path


def test_warmup_builds_the_static_chunk_steps_on_scratch_only(checkpoint):
    """`Engine.warmup` builds the three static chunk steps, on the scratch state row and page only."""
    engine = make_engine(checkpoint("tiny"), "float32", True, k=2)
    conv, ssm = engine.states.conv[:, :-1].clone(), engine.states.ssm[:, :-1].clone()
    kv = engine.pages.storage[:, :, :-1].clone()
    engine.warmup()
    assert set(engine.runner.chunk_graphs._steps) == {"first", "next", "mtp"}
    assert torch.equal(engine.states.conv[:, :-1], conv) and torch.equal(engine.states.ssm[:, :-1], ssm)
    assert torch.equal(engine.pages.storage[:, :, :-1], kv)


def test_warmup_of_a_chunk_longer_than_the_pool_stays_on_the_scratch_page(checkpoint):
    """A pool smaller than one prefill chunk (`qwen-mtp bench` sizes its pool to the batch: 13 pages of 16 for one
    128-token prompt beside 512-token chunks): the static chunk steps' padding gives every position of the chunk a
    page (the scratch page), so their warm-up reads no page index past its table (on the H200 it read whatever
    followed the table and faulted, "illegal memory access"; the CPU reference reads only the pages a table has);
    and a request gets the tokens it gets without the static steps."""
    path = checkpoint("tiny")
    small = dict(num_pages=3, page_size=CHUNK, prefill_chunk=4 * CHUNK)  # a pool of 48 tokens, chunks of 64
    engine = make_engine(path, "float32", True, 2, **small)
    kv = engine.pages.storage[:, :, :-1].clone()
    engine.warmup()
    graphs = engine.runner.chunk_graphs
    assert set(graphs._steps) == {"first", "next", "mtp"}
    for step in graphs._steps.values():
        tables = step.padding["tables"]
        assert tables.shape[1] * engine.pages.page_size >= graphs.length
        assert bool((tables == engine.pages.scratch_page).all())
    assert torch.equal(engine.pages.storage[:, :, :-1], kv)
    prompt = random_prompt(CHUNK + 3, seed=901)
    expected = make_engine(path, "float32", False, 2, **small).generate([prompt], max_new_tokens=8)
    assert engine.generate([prompt], max_new_tokens=8)[0].token_ids == expected[0].token_ids


def test_prefill_graphs_and_compiled_prefill_exclude_each_other():
    overrides = ("model.fixture=tiny", "compile.enabled=true", "compile.prefill=true", "compile.prefill_graphs=true")
    with pytest.raises(RecipeError, match="exclude each other"):
        load_recipe(None, overrides)


@pytest.mark.parametrize(
    "settings, graphs, tensor_parallel, on",
    [
        ({}, True, False, True),  # null: on wherever the decode steps are graphed
        ({}, False, False, False),  # CPU, or compile.cuda_graphs: false
        ({}, True, True, False),  # tensor parallelism
        ({"enabled": True, "prefill": True}, True, False, False),  # compiled prefill chunks
        ({"prefill_graphs": False}, True, False, False),
        ({"prefill_graphs": True}, False, False, True),  # the static inputs without capture
    ],
)
def test_prefill_graphs_default_follows_the_decode_graphs(settings, graphs, tensor_parallel, on):
    assert prefill_graphs_on(CompileSection(**settings), graphs, tensor_parallel) is on


def test_default_cpu_engine_runs_chunks_eagerly(checkpoint):
    """The default (null) on CPU, where nothing is graphed: no static chunk steps."""
    recipe = {"model": {"path": str(checkpoint("tiny")), "device": "cpu"}, "cache": {"prefill_chunk": CHUNK}}
    assert Engine.from_recipe(recipe, log=lambda _: None).runner.chunk_graphs is None
