"""Lossless MTP speculation: MTP-on tokens == MTP-off tokens == Hugging Face greedy, for K = 1..4, batch 1 and
8, fp32 and bf16, real-head and oracle drafts; states committed by index equal plain decoding's bit for bit."""

import functools

import pytest
import torch
from helpers import assert_matches_reference, hf_greedy_with_margins, load_hf, random_prompt

from qwen_mtp import Engine, RecipeError, SamplingParams

MAX_NEW = 12


def make_engine(path, dtype="float32", k=None, draft="head", accept=1.0, **cache):
    recipe = {"model": {"path": str(path), "dtype": dtype, "device": "cpu"}, "cache": cache}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": accept}
    return Engine.from_recipe(recipe, log=lambda _: None)


def batch_prompts(k):
    # mixed lengths, including 1 and exactly K+1 (vLLM #53051 broke on the latter)
    return [random_prompt(n, seed=100 + n) for n in (1, k + 1, 5, 33, 64, 70, 2, 19)]


@functools.cache
def hf_reference(path, dtype, prompt):
    """HF's greedy tokens and their top-2 margins (None in fp32: every token is compared)."""
    tokens, margins = hf_greedy_with_margins(load_hf(path, getattr(torch, dtype)), list(prompt), MAX_NEW, eos_ids=None)
    return tokens, None if dtype == "float32" else margins


def generate(engine, prompts):
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)]


def assert_reclaimed(engine):
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["free_state_rows"] == stats["total_state_rows"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_matches_plain_and_hf_batch1_and_batch8(checkpoint, k, dtype):
    path = checkpoint("tiny")
    prompts = batch_prompts(k)
    plain = make_engine(path, dtype)
    spec = make_engine(path, dtype, k=k, prefill_chunk=32)  # chunked prefill mixed with verify steps
    off = generate(plain, prompts)
    assert generate(spec, prompts) == off  # batch 8
    assert [generate(spec, [p])[0] for p in prompts[:3]] == off[:3]  # batch 1
    compared = sum(
        assert_matches_reference(ours, *hf_reference(path, dtype, tuple(p)), f"prompt of {len(p)} tokens")
        for ours, p in zip(off, prompts, strict=True)
    )
    # fp32: every token. bf16: the tokens before HF's own near-ties (tests/helpers.py), a third at least.
    assert compared == MAX_NEW * len(prompts) if dtype == "float32" else compared >= MAX_NEW * len(prompts) // 3
    assert spec.stats()["verify_steps"] > 0
    assert_reclaimed(spec)


@pytest.mark.parametrize("accept", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_oracle_drafts_match_plain(checkpoint, k, accept):
    path = checkpoint("tiny-8l")
    prompts = batch_prompts(k)
    off = generate(make_engine(path), prompts)
    spec = make_engine(path, k=k, draft="oracle", accept=accept)
    results = spec.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == off
    stats = spec.stats()
    if accept == 1.0:
        # every verify step not cut by max_new_tokens accepts all K drafts
        for result in results:
            lengths = result.spec.accept_lengths
            assert all(n == k + 1 for n in lengths[:-1]), lengths
            assert sum(lengths) >= MAX_NEW - 1
        assert stats["position_acceptance"][0] > 0.8
    elif accept == 0.5:
        assert 1.2 < stats["acceptance_length"] < k + 1
    assert_reclaimed(spec)


def committed_states(engine, prompt, oracle=None):
    """Run one request alone; after every step, the committed (conv window, SSM state) of each GDN layer,
    keyed by the number of positions the target has consumed."""
    params = SamplingParams(30, ignore_eos=True)
    rid = engine.submit(prompt, params) if oracle is None else engine.submit_with_oracle(prompt, oracle, params)
    seen = {}
    while True:
        engine.step()
        request = engine.requests[rid]
        if request.done:
            return seen, engine.result(rid).token_ids
        row = torch.tensor([engine.states.rows[rid]])
        seen[request.num_computed] = [engine.states.read(layer, row) for layer in engine.states.layer_index]


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_committed_states_equal_plain_decoding_bitwise(checkpoint, state_dtype):
    """After each step that accepted j drafts, the committed SSM state and conv window of every GDN layer are
    those of plain decoding after the same tokens, bit for bit (also through a bf16 state pool)."""
    # lookahead off: with it, the step after each one is already in flight when the states are read
    recipe = {"model": {"path": str(checkpoint("tiny")), "dtype": "float32"}, "state": {"dtype": state_dtype}}
    recipe["cache"] = {"lookahead": False}
    prompt = random_prompt(21, seed=7)
    plain, plain_tokens = committed_states(Engine.from_recipe(recipe, log=lambda _: None), prompt)
    recipe["mtp"] = {"enabled": True, "k": 3, "draft": "oracle", "oracle_accept": 0.6}
    spec, spec_tokens = committed_states(Engine.from_recipe(recipe, log=lambda _: None), prompt, plain_tokens)
    assert spec_tokens == plain_tokens
    assert len(spec) >= 5 and set(spec) <= set(plain) and len(spec) < len(plain)  # several multi-token accepts
    for n, layers in spec.items():
        for (window, ssm), (plain_window, plain_ssm) in zip(layers, plain[n], strict=True):
            assert torch.equal(window, plain_window) and torch.equal(ssm, plain_ssm), n


def test_mtp_kv_is_rebuilt_from_target_hidden_states(checkpoint):
    """After verify steps, the MTP layer's KV at every committed position equals the MTP head run over the
    final sequence with the *target's* hidden states, and the next draft d1 is that head's argmax: the
    catch-up really replaces the draft chain's provisional entries (else acceptance silently drops)."""
    path = checkpoint("tiny")
    engine = make_engine(path, k=3, draft="oracle", accept=0.5)
    prompt = random_prompt(9, seed=3)
    oracle = generate(make_engine(path), [prompt])[0] + [0] * 8
    rid = engine.submit_with_oracle(prompt, oracle, SamplingParams(20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    request = engine.requests[rid]
    n = request.num_computed
    tokens = torch.tensor([request.tokens])  # n + 1 tokens: the last one not consumed yet
    model = engine.model
    with torch.inference_mode():
        hidden = model.hidden_states(tokens[:, :n])
        from qwen_mtp.cache import SequenceCache

        cache = SequenceCache(1)
        mtp_hidden = model.mtp_hidden_states(tokens[:, 1:], hidden, torch.arange(n)[None], cache)
        ref_k, ref_v = cache.kv["mtp.layers.0"]  # [1, KV, n, D]
        k, v = engine.pages.read("mtp.layers.0", rid, n)  # [n, KV, D]
        torch.testing.assert_close(k.transpose(0, 1)[None], ref_k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v.transpose(0, 1)[None], ref_v, rtol=1e-4, atol=1e-4)
        head_d1 = int(model.logits(mtp_hidden[:, -1]).argmax())
    assert request.spec.verify_steps >= 3
    # d1 is the head's own proposal unless the oracle replaced it
    assert request.drafts[0] in (head_d1, oracle[n + 1 - len(prompt)])


def test_mtp_cancel_readmit_and_lifecycle(checkpoint):
    import random

    path = checkpoint("tiny")
    cache = {"page_size": 8, "num_pages": 30, "num_state_rows": 3, "max_batch": 3, "prefill_chunk": 16}
    engine = make_engine(path, k=2, **cache)
    plain = make_engine(path, **cache)
    rng = random.Random(99)
    submitted, cancelled = {}, set()
    for _ in range(200):
        if rng.random() < 0.3:
            prompt = random_prompt(rng.randint(1, 40), seed=rng.randint(0, 10**6))
            max_new = rng.randint(1, 15)
            submitted[engine.submit(prompt, SamplingParams(max_new, ignore_eos=True))] = (prompt, max_new)
        live = [r for r in submitted if not engine.requests[r].done]
        if live and rng.random() < 0.06:
            victim = rng.choice(live)
            engine.cancel(victim)
            cancelled.add(victim)
            # re-admission of a cancelled request gives the same tokens as its first (plain) run
            prompt, max_new = submitted[victim]
            submitted[engine.submit(prompt, SamplingParams(max_new, ignore_eos=True))] = (prompt, max_new)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert_reclaimed(engine)
    assert len(cancelled) >= 3
    for rid, (prompt, max_new) in submitted.items():
        if rid not in cancelled:
            expected = plain.generate([prompt], max_new_tokens=max_new, ignore_eos=True)[0].token_ids
            assert engine.result(rid).token_ids == expected


def test_mtp_stops_at_eos_exactly_like_plain(checkpoint):
    path = checkpoint("tiny")
    prompt = random_prompt(6, seed=11)
    free = generate(make_engine(path), [prompt])[0]
    for k in (2, 4):
        plain, spec = make_engine(path), make_engine(path, k=k, draft="oracle", accept=1.0)
        plain.eos_ids = spec.eos_ids = {free[4]}
        expected = plain.generate([prompt], max_new_tokens=MAX_NEW)[0]
        got = spec.generate([prompt], max_new_tokens=MAX_NEW)[0]
        assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason == "stop"
        assert got.token_ids[-1] == free[4] and got.spec.verify_steps >= 1


def test_mtp_needs_an_mtp_head(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    plain = shutil.copytree(checkpoint("tiny"), tmp_path / "no-mtp")
    tensors = {k: v for k, v in load_file(plain / "model.safetensors").items() if not k.startswith("mtp.")}
    save_file(tensors, plain / "model.safetensors")
    with pytest.raises(RecipeError, match=r"mtp\.enabled: checkpoint .* has no mtp\.\* weights"):
        make_engine(plain, k=2)
    with pytest.raises(RecipeError, match=r"mtp\.k must be 1\.\.4 or auto, got 5"):
        make_engine(plain, k=5)


def test_stop_token_ids_cut_mtp_exactly_like_plain(checkpoint):
    """A stop token ends a request where plain decoding stops (the token included), whichever verify step
    emits it and however many drafts that step accepted; with ignore_eos too."""
    path = checkpoint("tiny")
    prompts = [random_prompt(n, seed=30 + n) for n in (6, 17)]
    free = generate(make_engine(path), prompts)
    stops = [free[0][5], free[1][2]]
    params = SamplingParams(MAX_NEW, ignore_eos=True, stop_token_ids=stops)
    expected = make_engine(path).generate(prompts, params)
    for result, tokens in zip(expected, free, strict=True):
        cut = min(tokens.index(s) for s in stops if s in tokens) + 1
        assert result.finish_reason == "stop" and result.token_ids == tokens[:cut]
    for k, draft in ((2, "oracle"), (4, "oracle"), (3, "head")):
        got = make_engine(path, k=k, draft=draft, accept=1.0).generate(prompts, params)
        assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in expected]


def test_one_read_back_per_step(checkpoint, monkeypatch):
    """Verify -> accept -> commit -> draft read nothing on the host: each step's results (first tokens, accepted
    counts, chosen tokens, next drafts) come back through one copy (`Runner.start_read`, then its `values()`),
    and no other tensor is read on the host during the step, except inside the ops' CPU references (which read
    lengths; on CUDA the kernels run instead, and tests/gpu/test_host_syncs.py counts the synchronisations)."""
    import traceback

    path = checkpoint("tiny")
    engine = make_engine(path, k=3, draft="oracle", accept=0.6, prefill_chunk=16, lookahead=False)  # one launch a step
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 12)]
    oracles = generate(make_engine(path), prompts)
    params = SamplingParams(MAX_NEW, ignore_eos=True)
    ids = [engine.submit_with_oracle(p, o, params) for p, o in zip(prompts, oracles, strict=True)]
    reads = {"read_back": 0, "host": 0}
    start_read = engine.runner.start_read

    def counted_start_read(parts):
        reads["read_back"] += 1
        reads["host"] -= 1  # the tolist of its values()
        return start_read(parts)

    def host_read(original):
        def read(self, *args, **kwargs):
            if not any("/qwen_mtp/ops/" in frame.filename for frame in traceback.extract_stack()):
                reads["host"] += 1
            return original(self, *args, **kwargs)

        return read

    engine.runner.start_read = counted_start_read
    steps = 0
    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, host_read(getattr(torch.Tensor, name)))
        while engine.has_unfinished():
            engine.step()
            steps += 1
            assert reads == {"read_back": steps, "host": 0}, steps
    assert [engine.result(i).token_ids for i in ids] == oracles
    assert engine.stats()["verify_steps"] > steps - 4  # most steps verified (the first ones prefill)


def test_a_failing_mtp_step_ends_only_its_requests(checkpoint):
    """A draft step that raises after its verify committed ends the requests verified in it (finish_reason
    "error", pages and rows back); a request in prefill in the same step goes on to MTP-off's tokens."""
    path = checkpoint("tiny")
    engine = make_engine(path, k=2, prefill_chunk=8, page_size=8, lookahead=False)  # the fault hits the next launch
    prompts = [random_prompt(n, seed=90 + n) for n in (5, 30)]
    params = SamplingParams(MAX_NEW, ignore_eos=True)
    verifying = engine.submit(prompts[0], params)
    while engine.requests[verifying].spec.verify_steps < 2:
        engine.step()
    prefilling = engine.submit(prompts[1], params)
    propose, fault = engine.speculator.propose, RuntimeError("injected fault")

    def failing_propose(requests, verified):
        raise fault

    engine.speculator.propose = failing_propose
    engine.step()
    engine.speculator.propose = propose
    failed = engine.result(verifying)
    assert failed.finish_reason == "error" and failed.error is fault
    while engine.has_unfinished():
        engine.step()
    assert engine.result(prefilling).token_ids == generate(make_engine(path), [prompts[1]])[0]
    assert_reclaimed(engine)
    assert engine.requests == {}
