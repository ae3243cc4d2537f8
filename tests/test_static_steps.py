"""The decode path on static shapes (`compile.*`): batch buckets with padding rows on the scratch state row
and page, and `torch.compile(fullgraph=True)` over whole steps (aot_eager on CPU: it proves the steps trace as
one graph; the GPU suite runs inductor + CUDA graphs). MTP-on must still equal MTP-off and Hugging Face."""

import pytest
import torch
from helpers import hf_greedy, load_hf, random_prompt
from torch.utils import _pytree as pytree

from qwen_mtp import Engine
from qwen_mtp.engine.graphs import copy_outputs, static_copies

MAX_NEW = 10


def make_engine(path, k=None, draft="head", accept=1.0, backend="aot_eager", **cache):
    recipe = {
        "model": {"path": str(path), "dtype": "float32", "device": "cpu"},
        "cache": {"max_batch": 4, **cache},
        "compile": {"enabled": True, "backend": backend, "batch_sizes": [2, 4]},
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": accept}
    return Engine.from_recipe(recipe, log=lambda _: None)


def generate(engine, prompts):
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)]


@pytest.mark.parametrize("k", [1, 3])
def test_compiled_buckets_mtp_equals_plain_equals_hf(checkpoint, k):
    path = checkpoint("tiny")
    prompts = [random_prompt(n, seed=300 + n) for n in (1, k + 1, 9, 40, 3)]  # 5 prompts: buckets 2 and 4
    plain = make_engine(path)
    spec = make_engine(path, k=k, prefill_chunk=16)
    expected = generate(plain, prompts)
    hf = load_hf(path, torch.float32)
    assert expected == [hf_greedy(hf, p, MAX_NEW, eos_ids=None) for p in prompts]
    assert generate(spec, prompts) == expected
    assert [generate(spec, [p])[0] for p in prompts[:2]] == expected[:2]  # a batch of 1 in bucket 2
    stats = spec.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["verify_steps"] > 0
    shapes = sorted(spec.runner.graphs._steps)
    assert shapes == [("draft", 2, k + 1), ("draft", 4, k + 1), ("target", 2, k + 1), ("target", 4, k + 1)]


def test_padding_rows_touch_only_scratch_state(checkpoint):
    """A padded step leaves every state row and page that a request could own exactly as it was."""
    engine = make_engine(checkpoint("tiny"), k=2, draft="oracle", accept=1.0, backend="eager")
    engine.generate([random_prompt(20, seed=1)], max_new_tokens=6, ignore_eos=True)
    conv, ssm = engine.states.conv[:, :-1].clone(), engine.states.ssm[:, :-1].clone()
    kv = engine.pages.storage[:, :, :-1].clone()
    engine.warmup()  # builds every bucket's steps
    steps = engine.runner.graphs._steps
    assert len(steps) == 6  # buckets 2, 4 x (decode, verify, draft)
    for step in steps.values():  # a step over zero requests: every row is padding
        with torch.inference_mode():
            step(0, **{name: value[:0] for name, value in step.padding.items()})
    assert torch.equal(engine.states.conv[:, :-1], conv) and torch.equal(engine.states.ssm[:, :-1], ssm)
    assert torch.equal(engine.pages.storage[:, :, :-1], kv)
    assert engine.states.scratch_row == engine.states.num_rows and engine.pages.scratch_page == engine.pages.num_pages


def test_oracle_acceptance_under_buckets(checkpoint):
    path = checkpoint("tiny-8l")
    prompts = [random_prompt(n, seed=n) for n in (4, 17, 30)]
    spec = make_engine(path, k=2, draft="oracle", accept=1.0, backend="eager")
    plain = make_engine(path, backend="eager")
    assert generate(spec, prompts) == generate(plain, prompts)
    assert spec.stats()["acceptance_length"] > 2.5


def test_fused_projections_mtp_equals_plain_equals_hf(checkpoint):
    """The layout CUDA engines run (`model.use_one_gemm()`: the ops read strided slices of one GEMM output),
    exercised on CPU through the ops' references and the compiled step: MTP-on == MTP-off == Hugging Face."""
    path = checkpoint("tiny")
    prompts = [random_prompt(n, seed=500 + n) for n in (2, 11, 37)]
    plain, spec = make_engine(path), make_engine(path, k=2, prefill_chunk=16)
    for engine in (plain, spec):
        engine.model.use_one_gemm()
    expected = generate(plain, prompts)
    hf = load_hf(path, torch.float32)
    assert expected == [hf_greedy(hf, p, MAX_NEW, eos_ids=None) for p in prompts]
    assert generate(spec, prompts) == expected


def test_inductor_gets_a_fallback_for_every_op():
    """Each qwen_mtp op has an explicit inductor lowering (a fallback) once a compiled StepGraphs exists, so
    inductor never builds its implicit-fallback log text (exponential in the layers on torch 2.11)."""
    from torch._inductor import lowering

    import qwen_mtp.engine.runner  # noqa: F401  (registers the ops)
    from qwen_mtp.engine.graphs import register_inductor_fallbacks

    register_inductor_fallbacks()
    names = list(torch.ops.qwen_mtp)
    assert {"gdn_recurrent", "gdn_chunked", "paged_attention", "linear"} <= set(names)
    assert all(getattr(torch.ops.qwen_mtp, name).default in lowering.lowerings for name in names)


def test_inductor_compiled_prefill_writes_what_eager_writes(checkpoint):
    """Prefill compiled by inductor with dynamic shapes (C++ code on CPU) fills every layer's pages and state
    rows as eager prefill does, and MTP-on still equals MTP-off. Guards a real failure: with symbolic pool
    sizes, inductor dropped the storage offset of the MTP layer's KV view and wrote into layer 0's pages."""
    path = checkpoint("tiny")
    prompt = random_prompt(21, seed=7)  # chunks of 16 and 5 tokens: the second reads the first's state

    def run(compiled: bool, k: int | None):
        engine = make_engine(path, k=k, prefill_chunk=16)
        engine.runner.graphs = None  # decode eagerly: only prefill is compiled here
        if compiled:
            engine.runner.compile_prefill("inductor", log=lambda _: None)
        pools, mtp_pass = [], engine.runner.prefill_mtp

        def prefill_mtp(*args):  # the pools after each chunk's target and MTP passes
            result = mtp_pass(*args)
            pools.append((engine.pages.storage.clone(), engine.states.conv.clone(), engine.states.ssm.clone()))
            return result

        engine.runner.prefill_mtp = prefill_mtp
        return generate(engine, [prompt])[0], pools

    (_, eager_pools), (tokens, pools) = run(False, 2), run(True, 2)
    assert len(pools) == len(eager_pools) == 2
    for got, want in zip(pools, eager_pools, strict=True):
        for pool, expected in zip(got, want, strict=True):  # KV pages, conv windows, SSM states
            for layer, expected_layer in zip(pool, expected, strict=True):
                # Inductor's C++ code sums fp32 in another order than eager (vectorised, FMA-contracted), so an
                # entry may be a few dozen ulps of the layer's largest value off: measured up to 5e-6 of it on
                # AVX-512 (1.9e-5 absolute). A layer's KV written into another layer's pages is off by the
                # values themselves (the MTP layer's keys copied into layer 0: 4.7 off, 3.6e-4 allowed). So
                # each layer is held to 1e-4 of its own magnitude.
                scale = expected_layer.abs().max().item()
                torch.testing.assert_close(layer, expected_layer, rtol=0, atol=1e-4 * scale)
    assert tokens == run(True, None)[0]


def test_static_outputs_copy_every_tensor_and_keep_none():
    """A captured step writes its outputs into copies outside the graph pool (graphs.StaticStep); the copy
    covers nested tuples (logprobs) and leaves None (a mode without logprobs) alone."""
    for logprobs in (None, (torch.ones(2), torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3))):
        first = (torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), logprobs)
        static = static_copies(first)
        assert static[0].data_ptr() != first[0].data_ptr()
        later = pytree.tree_map(lambda t: t + 5 if isinstance(t, torch.Tensor) else t, first)
        copy_outputs(static, later)
        pairs = zip(pytree.tree_leaves(static), pytree.tree_leaves(later), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs if a is not None)
        assert (static[2] is None) == (logprobs is None)


def test_no_collection_turns_the_collector_off_and_back_as_it_was():
    import gc

    from qwen_mtp.engine.graphs import no_collection

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
