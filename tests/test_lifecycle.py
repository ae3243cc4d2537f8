"""Request lifecycle: cancellation, re-admission, reclamation of every page and state row, pressure, bad
input at submit, a long randomized run with no leaks and solo-identical tokens; abandoned streams, other threads
submitting and generating, and steps that raise."""

import random

import pytest
from helpers import random_prompt, random_traffic

from qwen_mtp import Engine, RequestError, SamplingParams


def make_engine(path, compile_settings=None, **cache):
    recipe = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "cache": cache}
    return Engine.from_recipe({**recipe, "compile": compile_settings or {}}, log=lambda _: None)


def assert_all_reclaimed(engine):
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"]
    assert stats["free_state_rows"] == stats["total_state_rows"]
    assert stats["running"] == stats["waiting"] == 0
    assert not engine.pages.tables and not engine.states.rows and engine.pages.available_pages == stats["total_pages"]


def run_until(engine, predicate, limit=500):
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError("condition never reached")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from qwen_mtp.testing import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")


def solo(path, prompt, max_new, **cache):
    return make_engine(path, **cache).generate([prompt], max_new_tokens=max_new, ignore_eos=True)[0].token_ids


def test_cancel_mid_prefill_and_resubmit(path):
    engine = make_engine(path, prefill_chunk=8, page_size=8)
    prompt = random_prompt(40, seed=1)
    rid = engine.submit(prompt, SamplingParams(10, ignore_eos=True))
    engine.step()
    engine.step()
    request = engine.requests[rid]
    assert (
        request.in_prefill
        and request.num_computed == 16
        and engine.stats()["free_pages"] < engine.stats()["total_pages"]
    )
    assert engine.cancel(rid) and not engine.cancel(rid)
    assert engine.result(rid).finish_reason == "cancelled"
    assert_all_reclaimed(engine)
    again = engine.generate([prompt], max_new_tokens=10, ignore_eos=True)[0]
    assert again.token_ids == solo(path, prompt, 10, prefill_chunk=8, page_size=8)
    assert_all_reclaimed(engine)


def test_cancel_mid_decode_and_resubmit_gives_same_tokens(path):
    engine = make_engine(path, page_size=4)
    prompts = [random_prompt(n, seed=n) for n in (12, 5)]
    first = engine.submit(prompts[0], SamplingParams(20, ignore_eos=True))
    other = engine.submit(prompts[1], SamplingParams(20, ignore_eos=True))
    run_until(engine, lambda: len(engine.requests[first].output) >= 6)
    partial = list(engine.requests[first].output)
    engine.cancel(first)
    run_until(engine, lambda: engine.requests[other].done)
    assert_all_reclaimed(engine)
    full = engine.generate([prompts[0]], max_new_tokens=20, ignore_eos=True)[0].token_ids
    assert full[: len(partial)] == partial
    assert full == solo(path, prompts[0], 20, page_size=4)
    assert engine.result(other).token_ids == solo(path, prompts[1], 20, page_size=4)


def test_pressure_more_requests_than_pages_and_rows(path):
    """6 requests, room for 2 at a time: all complete, admitted in submission order, with solo tokens."""
    engine = make_engine(path, page_size=8, num_pages=8, num_state_rows=2, max_batch=4)
    prompts = [random_prompt(n, seed=n) for n in (20, 9, 25, 3, 14, 30)]
    ids = [engine.submit(p, SamplingParams(8, ignore_eos=True)) for p in prompts]
    admitted = []
    while engine.has_unfinished():
        engine.step()
        assert engine.stats()["running"] <= 2
        admitted += [r.id for r in engine.scheduler.running if r.id not in admitted]
    assert admitted == ids
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.result(rid).token_ids == solo(path, prompt, 8)
    assert_all_reclaimed(engine)


def test_bad_requests_are_refused_and_allocate_nothing(path):
    engine = make_engine(path, page_size=8, num_pages=4)
    good = engine.submit(random_prompt(10, seed=0), SamplingParams(5, ignore_eos=True))
    engine.step()
    before = engine.stats()
    for prompt, max_new, message in [
        ([], 3, "empty prompt"),
        ([1, 99999], 3, "outside the vocabulary"),
        ([1, 2], 0, "max_new_tokens must be an integer >= 1"),
        ([1] * 30, 10, "needs 5 KV pages but the whole pool has 4"),
        ([1] * 4090, 10, "max_position_embeddings"),
    ]:
        with pytest.raises(RequestError, match=message):
            engine.submit(prompt, SamplingParams(max_new))
    assert engine.stats() == before
    run_until(engine, lambda: engine.requests[good].done)
    assert engine.result(good).token_ids == solo(path, random_prompt(10, seed=0), 5)
    assert_all_reclaimed(engine)


@pytest.mark.parametrize(
    "mixed, arrivals, least, prefill_graphs",
    [(False, 300, (40, 3), False), (True, 150, (30, 5), False), (True, 150, (30, 5), True)],
    ids=["unpacked", "mixed-steps", "mixed-steps-prefill-graphs"],
)
def test_randomized_lifecycle_no_leaks_and_solo_tokens(path, mixed, arrivals, least, prefill_graphs):
    """Seeded arrivals, cancellations and lengths over hundreds of steps under memory pressure (arrivals for
    the first `arrivals` steps); with mixed steps the chunks are packed under a budget of 3 decode rows + 24
    prefill tokens (a chunk and a short one). With `compile.prefill_graphs` (its static inputs; no capture on CPU)
    the full chunks that run alone reuse one set of static buffers; the reference runs without them."""
    rng = random.Random(1234)
    cache = {"page_size": 8, "num_pages": 24, "num_state_rows": 3, "max_batch": 3, "prefill_chunk": 16}
    if mixed:
        cache.update(mixed_steps=True, max_step_tokens=3 + 16 + 8)
    engine = make_engine(path, {"cuda_graphs": False, "prefill_graphs": prefill_graphs}, **cache)

    def submit(rng):
        prompt = random_prompt(rng.randint(1, 60), seed=rng.randint(0, 10**6))
        max_new = rng.randint(1, 20)
        return engine.submit(prompt, SamplingParams(max_new, ignore_eos=True)), (prompt, max_new)

    def pools_in_bounds():
        stats = engine.stats()
        assert 0 <= stats["free_pages"] <= stats["total_pages"] and engine.pages.available_pages >= 0

    submitted, cancelled = random_traffic(engine, rng, arrivals, 0.3, 0.05, submit, pools_in_bounds)
    assert_all_reclaimed(engine)
    finished = [rid for rid in submitted if rid not in cancelled]
    assert len(finished) > least[0] and len(cancelled) > least[1]
    if prefill_graphs:
        assert set(engine.runner.chunk_graphs._steps) == {"packed-first", "packed-next"}
    reference = make_engine(path, **cache)
    for rid in finished:
        prompt, max_new = submitted[rid]
        result = engine.result(rid)
        assert result.finish_reason == "length" and len(result.token_ids) == max_new
        assert result.token_ids == reference.generate([prompt], max_new_tokens=max_new, ignore_eos=True)[0].token_ids


# ---- streams, threads and failures ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "break", "garbage"])
def test_abandoned_stream_cancels_its_requests_and_frees_their_pages(path, how):
    import gc

    engine = make_engine(path, page_size=8)
    prompts = [random_prompt(n, seed=n) for n in (12, 30)]
    other = engine.submit(random_prompt(9, seed=5), SamplingParams(12, ignore_eos=True))
    stream = engine.stream(prompts, max_new_tokens=20, ignore_eos=True)
    if how == "break":
        for _ in stream:
            break
        del stream
    else:
        next(stream)
        if how == "close":
            stream.close()
        else:
            del stream
            gc.collect()
    assert list(engine.requests) == [other]  # the stream's requests are cancelled and forgotten
    assert engine.stats()["running"] == 1 and engine.stats()["free_pages"] > 0
    run_until(engine, lambda: engine.requests[other].done)
    assert engine.result(other).token_ids == solo(path, random_prompt(9, seed=5), 12, page_size=8)
    assert_all_reclaimed(engine)
    assert engine.requests == {}


def test_submit_from_another_thread_while_the_engine_steps(path):
    import threading

    engine = make_engine(path)
    prompts = [random_prompt(n, seed=40 + n) for n in (7, 19, 3, 26, 11)]
    first = engine.submit(prompts[0], SamplingParams(30, ignore_eos=True))
    ids, started = [], threading.Event()

    def submitter():
        started.wait()
        for prompt in prompts[1:]:
            ids.append(engine.submit(prompt, SamplingParams(8, ignore_eos=True)))

    thread = threading.Thread(target=submitter)
    thread.start()
    steps = 0
    while not engine.requests[first].done:
        engine.step()
        steps += 1
        if steps == 2:
            started.set()
    thread.join()
    while engine.has_unfinished():
        engine.step()
    assert engine.result(first).token_ids == solo(path, prompts[0], 30)
    for rid, prompt in zip(ids, prompts[1:], strict=True):
        assert engine.result(rid).token_ids == solo(path, prompt, 8)
    assert_all_reclaimed(engine)


def test_four_threads_generating_on_one_engine_get_solo_tokens(path):
    from concurrent.futures import ThreadPoolExecutor

    engine = make_engine(path, max_batch=4, page_size=8)
    jobs = [[random_prompt(n, seed=60 + 7 * t + n) for n in (5, 13)] for t in range(4)]

    def generate(prompts):
        return [r.token_ids for r in engine.generate(prompts, max_new_tokens=10, ignore_eos=True)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(generate, jobs))
    reference = make_engine(path)
    for prompts, got in zip(jobs, results, strict=True):
        assert got == [r.token_ids for r in reference.generate(prompts, max_new_tokens=10, ignore_eos=True)]
    assert_all_reclaimed(engine)
    assert engine.requests == {}


def test_a_step_that_raises_ends_only_its_requests(path):
    """A prefill chunk that raises ends its request (finish_reason "error", the error kept, pages and row back);
    the others keep running and get their solo tokens. A failing decode batch ends the requests in it; a
    request still in prefill in that step carries on."""
    engine = make_engine(path, page_size=8, prefill_chunk=8, lookahead=False)  # each fault hits the next launch
    prompts = [random_prompt(n, seed=80 + n) for n in (6, 20, 11)]
    ids = [engine.submit(p, SamplingParams(8, ignore_eos=True)) for p in prompts]
    victim, fault = ids[1], RuntimeError("injected fault")
    prefill = engine.runner.prefill

    def failing_prefill(batch):
        if int(batch.state_rows[0]) == engine.states.rows[victim] and int(batch.positions[0, 0]) == 8:
            raise fault  # the victim's second chunk
        return prefill(batch)

    engine.runner.prefill = failing_prefill
    updates = []
    while engine.has_unfinished():
        updates += engine.step()
    result = engine.result(victim)
    assert result.finish_reason == "error" and result.error is fault and result.token_ids == []
    assert any(u.request_id == victim and u.finished and u.finish_reason == "error" for u in updates)
    for rid, prompt in zip(ids, prompts, strict=True):
        if rid != victim:
            assert engine.result(rid).token_ids == solo(path, prompt, 8, page_size=8, prefill_chunk=8)
    assert_all_reclaimed(engine)

    engine.runner.prefill = prefill
    decoding = engine.submit(prompts[0], SamplingParams(8, ignore_eos=True))
    run_until(engine, lambda: engine.requests[decoding].num_output == 2)
    late = engine.submit(prompts[1], SamplingParams(8, ignore_eos=True))  # in prefill when the decode fails
    decode = engine.runner.decode

    def failing_decode(batch):
        raise fault

    engine.runner.decode = failing_decode
    engine.step()
    engine.runner.decode = decode
    assert engine.result(decoding).finish_reason == "error"
    run_until(engine, lambda: engine.requests[late].done)
    assert engine.result(late).token_ids == solo(path, prompts[1], 8, page_size=8, prefill_chunk=8)
    assert_all_reclaimed(engine)
