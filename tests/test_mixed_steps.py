"""Mixed steps (`cache.mixed_steps`): a step's prefill chunks of several requests run as one packed forward next
to the decode and verify rows, and a request's tokens never depend on what it was packed with: packed with 0, 1
or 7 other requests' chunks and decode rows, MTP off and K = 2, fp32 and bf16, equal to its tokens alone and to
Hugging Face greedy; chunked == unchunked; the token budget's order (decode rows first, chunks in arrival order)."""

import pytest
import torch
from helpers import assert_greedy_matches_hf, load_hf, random_prompt

from qwen_mtp import Engine, RecipeError, SamplingParams
from qwen_mtp.engine.engine import DEFAULT_STEP_TOKENS, mixed_steps_on
from qwen_mtp.recipe import CacheSection

CHUNK = 16
MAX_NEW = 8
TARGET = random_prompt(45, seed=7)  # three chunks: 16 + 16 + 13
COMPANIONS = [random_prompt(n, seed=20 + n) for n in (40, 33, 50, 20, 64, 18, 37)]
DECODERS = [random_prompt(n, seed=90 + n) for n in (3, 6)]  # short prompts: decoding while the others prefill


def make_engine(path, dtype="float32", k=None, **cache):
    cache = {"mixed_steps": True, "prefill_chunk": CHUNK, "max_batch": 10, **cache}
    recipe = {"model": {"path": str(path), "dtype": dtype, "device": "cpu"}, "cache": cache}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k}
    return Engine.from_recipe(recipe, log=lambda _: None)


def record_packing(engine):
    """Wrap the packed forward: a list that gets, per step, the request ids of the chunks it packed."""
    steps, packed = [], engine.runner.prefill_packed

    def recording(chunks):
        steps.append([c.request.id for c in chunks])
        return packed(chunks)

    engine.runner.prefill_packed = recording
    return steps


def run_packed(engine, companions, decoders):
    """The target's tokens, submitted with `companions` (prefilling with it) after `decoders` started decoding;
    returns (target tokens, the most chunks its packed forwards held, whether decode rows ran beside them)."""
    params = SamplingParams(MAX_NEW, ignore_eos=True)
    steps = record_packing(engine)
    decoding = [engine.submit(p, SamplingParams(30, ignore_eos=True)) for p in decoders]
    while decoders and any(engine.requests[r].in_prefill for r in decoding):
        engine.step()
    target = engine.submit(TARGET, params)
    others = [engine.submit(p, params) for p in companions]
    beside_decodes = False
    while engine.has_unfinished():
        engine.step()
        beside_decodes |= bool(steps) and target in steps[-1] and any(not engine.requests[r].done for r in decoding)
    widest = max(len(ids) for ids in steps if target in ids)
    tokens = engine.result(target).token_ids
    for rid in others + decoding:
        engine.result(rid)
    return tokens, widest, beside_decodes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [None, 2])
def test_tokens_do_not_depend_on_what_the_chunks_were_packed_with(checkpoint, dtype, k):
    path = checkpoint("tiny")
    alone, widest, _ = run_packed(make_engine(path, dtype, k), [], [])
    assert widest == 1
    one, widest, _ = run_packed(make_engine(path, dtype, k), COMPANIONS[:1], [])
    assert widest == 2
    seven, widest, beside_decodes = run_packed(make_engine(path, dtype, k), COMPANIONS, DECODERS)
    assert widest == 8 and beside_decodes
    assert one == alone and seven == alone
    if k is None:  # MTP-on == MTP-off is the K = 2 case's own check below
        assert_greedy_matches_hf(alone, load_hf(path, getattr(torch, dtype)), TARGET, MAX_NEW)
    else:
        plain, _, _ = run_packed(make_engine(path, dtype), COMPANIONS, DECODERS)
        assert seven == plain


def test_packed_batch_equals_alone_and_hf_for_every_request(checkpoint):
    """Every request of a packed batch (all chunks of one step in one forward) gets its solo tokens, and
    fp32 equals HF greedy for each."""
    path = checkpoint("tiny-8l")
    prompts = [TARGET] + COMPANIONS[:3] + DECODERS
    engine = make_engine(path)
    steps = record_packing(engine)
    batched = [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)]
    assert max(len(ids) for ids in steps) == len(prompts)
    assert batched == [engine.generate([p], max_new_tokens=MAX_NEW, ignore_eos=True)[0].token_ids for p in prompts]
    hf = load_hf(path, torch.float32)
    for tokens, prompt in zip(batched, prompts, strict=True):
        assert_greedy_matches_hf(tokens, hf, prompt, MAX_NEW)


@pytest.mark.parametrize("chunk", [7, 64, 101])
def test_chunked_prefill_equals_unchunked_with_mixed_steps(checkpoint, chunk):
    path = checkpoint("tiny")
    prompt = random_prompt(101, seed=5)
    whole = make_engine(path, prefill_chunk=4096, max_step_tokens=8192)
    split = make_engine(path, prefill_chunk=chunk)
    expected = whole.generate([prompt], max_new_tokens=12, ignore_eos=True)[0].token_ids
    assert split.generate([prompt], max_new_tokens=12, ignore_eos=True)[0].token_ids == expected


def test_budget_takes_decode_rows_first_then_chunks_in_arrival_order(checkpoint):
    """Budget: 2 decode rows + one chunk + 8 tokens. Of three prompts in prefill the first runs; the second's
    chunk does not fit, and that ends the step's prefills: the third's 3 tokens would fit but never overtake."""
    path = checkpoint("tiny")
    engine = make_engine(path, max_batch=5, max_step_tokens=5 + CHUNK)
    engine.scheduler.max_step_tokens = 2 + CHUNK + 8  # below the recipe's floor on purpose: a tight step
    decoding = [engine.submit(p, SamplingParams(20, ignore_eos=True)) for p in DECODERS]
    engine.step()
    prompts = [random_prompt(40, seed=1), random_prompt(20, seed=2), random_prompt(3, seed=3)]
    waiting = [engine.submit(p, SamplingParams(4, ignore_eos=True)) for p in prompts]
    engine._drain()
    plan = engine.scheduler.schedule()
    assert [r.id for r in plan.decodes] == decoding
    assert [(c.request.id, c.length) for c in plan.prefills] == [(waiting[0], CHUNK)]
    assert waiting[1] not in plan.reach and waiting[2] not in plan.reach


def test_budget_below_decode_rows_plus_a_chunk_is_refused(checkpoint):
    with pytest.raises(RecipeError, match=r"cache.max_step_tokens \(39\) must hold .* at least 40"):
        make_engine(checkpoint("tiny"), max_batch=8, max_step_tokens=39, k=2)


def test_null_budget_holds_the_decode_rows_and_a_chunk(checkpoint):
    """`cache.max_step_tokens` null: DEFAULT_STEP_TOKENS, raised where the decode rows and one full chunk need more
    (a long `prefill_chunk`, as the bench sets for long prompts), so mixed steps on by default never refuse a recipe
    that runs without them."""
    path = checkpoint("tiny")
    assert make_engine(path, k=2).scheduler.max_step_tokens == DEFAULT_STEP_TOKENS
    long_chunk = make_engine(path, k=2, max_batch=4, prefill_chunk=DEFAULT_STEP_TOKENS)
    assert long_chunk.scheduler.max_step_tokens == DEFAULT_STEP_TOKENS + 4 * 3
    assert make_engine(path, max_step_tokens=100).scheduler.max_step_tokens == 100


@pytest.mark.parametrize("k", [None, 2])
def test_prefix_hits_in_packed_steps_equal_a_cold_run(checkpoint, k):
    """Prefix caching with mixed steps: requests restoring a cached system prompt and prefilling the rest in
    packed steps (beside a cold one) get the tokens and MTP drafts of a cold run, and do restore. The budget is
    the floor (10 decode rows + one chunk), so chunks that do not fit wait (and take no snapshot slot)."""
    from prefix_helpers import Recorder

    path = checkpoint("tiny")
    system = random_prompt(2 * CHUNK, seed=3)
    prompts = [system + random_prompt(n, seed=40 + n) for n in (5, 21, 9)] + [random_prompt(30, seed=8)]
    budget = 10 * (1 if k is None else k + 1) + CHUNK
    cached = make_engine(path, k=k, prefix_caching=True, page_size=8, max_step_tokens=budget)
    cached.generate([system + [1]], max_new_tokens=1, ignore_eos=True)
    warm, cold = Recorder(cached), Recorder(make_engine(path, k=k, page_size=8))
    steps = record_packing(cached)
    ids = {}
    for recorder in (warm, cold):
        ids[recorder] = [recorder.submit(prompt, MAX_NEW) for prompt in prompts]
        recorder.finish()
    # with MTP a cached chunk's MTP KV holds the token after it: the second chunk is a hit only for its own next token
    restored = 3 * (2 if k is None else 1) * CHUNK
    assert cached.stats()["prefix_tokens_saved"] == restored and max(len(s) for s in steps) >= 2
    for record in ("outputs", "drafts"):
        assert [getattr(warm, record)[i] for i in ids[warm]] == [getattr(cold, record)[i] for i in ids[cold]]
    cached.clear_prefix_cache()
    stats = cached.stats()
    assert stats["prefix_free_snapshot_slots"] == stats["prefix_snapshot_slots"], stats


def chunk_hidden_states(engine, prompts):
    """Run `prompts` (the first one the target) to the end; the target's chunks' hidden states from the packed
    forwards, in order."""
    seen, packed = [], engine.runner.prefill_packed

    def recording(chunks):
        hidden = packed(chunks)
        seen.extend(h.clone() for c, h in zip(chunks, hidden, strict=True) if c.request.id == target)
        return hidden

    engine.runner.prefill_packed = recording
    target, *_ = [engine.submit(p, SamplingParams(2, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_chunk_hidden_states_are_bitwise_those_alone(checkpoint, dtype):
    """Below the tokens: each of the target's three chunks gives bit for bit the same hidden states packed with
    3 other chunks as alone."""
    path = checkpoint("tiny-8l")
    alone = chunk_hidden_states(make_engine(path, dtype), [TARGET])
    packed = chunk_hidden_states(make_engine(path, dtype), [TARGET] + COMPANIONS[:3])
    assert len(alone) == len(packed) == 3
    assert all(torch.equal(a, b) for a, b in zip(alone, packed, strict=True))


@pytest.mark.parametrize(
    "setting, device, tensor_parallel, on",
    [
        (None, "cuda", False, True),  # null: on on one CUDA device
        (None, "cpu", False, False),  # the invariant linears' CPU reference runs row by row
        (None, "cuda", True, False),  # packed steps have not run with tensor parallelism
        (False, "cuda", False, False),
        (True, "cpu", False, True),
    ],
)
def test_mixed_steps_default_is_on_for_one_cuda_device(setting, device, tensor_parallel, on):
    cache = CacheSection(mixed_steps=setting)
    assert mixed_steps_on(cache, torch.device(device), tensor_parallel) is on


def test_default_cpu_engine_runs_chunks_unpacked(checkpoint):
    engine = Engine.from_recipe({"model": {"path": str(checkpoint("tiny")), "device": "cpu"}}, log=lambda _: None)
    assert not engine.mixed_steps and engine.scheduler.max_step_tokens is None
