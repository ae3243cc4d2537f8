"""K per step (`mtp.k: auto`): the policy as a pure function of acceptance and step times, and the engine with K
changing between steps (K = 0 plain steps included, longer drafts truncated, missing ones filled): MTP-on ==
MTP-off whatever K each step uses, greedy and sampled at batch 8, with a scripted K sequence and with the real
policy; a K = 0 step runs no MTP work, and the MTP KV of the positions it decoded is what a fixed K writes (up to
fp32 rounding) once K rises, so acceptance after K = 0 steps stays as good."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from helpers import cpu_engine, no_step_times, random_prompt

from qwen_mtp import Engine, SamplingParams
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine import speculative
from qwen_mtp.engine.k_policy import AcceptanceAverage, KPolicy, StepTimes, best_k, expected_tokens
from qwen_mtp.engine.speculative import spread_tokens
from qwen_mtp.serve.metrics import ServerMetrics

MAX_NEW = 14
PROMPTS = [random_prompt(n, seed=700 + n) for n in (1, 4, 5, 33, 2, 19, 9, 17)]


class Scripted(KPolicy):
    """A K policy that replays a fixed sequence (cycled) and records what the engine asked it; the rest
    (acceptance figures, `stepped`) is `KPolicy`'s own."""

    def __init__(self, ks, max_k=4):
        super().__init__(max_k, [1], no_step_times)
        self.ks, self.used, self.observed = itertools.cycle(ks), [], []

    def choose(self, count):
        self.used.append(next(self.ks))
        return self.used[-1]

    def observe(self, drafted, accepted):
        self.observed.append((drafted, accepted))
        super().observe(drafted, accepted)

    def measured(self, count):
        return True


def greedy(i):
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


def sampled(i):
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5 * i + 2)


def run(engine, params, prompts=PROMPTS, oracles=None):
    """Every prompt with params(i), as one continuous batch (oracle drafts: replaying `oracles`)."""
    if oracles is not None:
        ids = [
            engine.submit_with_oracle(p, o, params(i)) for i, (p, o) in enumerate(zip(prompts, oracles, strict=True))
        ]
    else:
        ids = [engine.submit(p, params(i)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [engine.result(i).token_ids for i in ids]


# ---- the policy ---------------------------------------------------------------------------------------------
def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([1.0, 1.0], 2) == 3.0


def test_best_k_trades_acceptance_against_step_time():
    flat = StepTimes(verify=(1.0,) * 5, draft=(0.0, 0.1, 0.2, 0.3, 0.4))  # small batch: verify costs the same
    steep = StepTimes(verify=(1.0, 2.0, 3.0, 4.0, 5.0), draft=(0.0, 0.1, 0.2, 0.3, 0.4))  # compute-bound batch
    good, poor = [0.9, 0.8, 0.7, 0.6], [0.3, 0.2, 0.1, 0.1]
    assert best_k(good, flat) == 4
    assert best_k(poor, flat) == 1  # 1.3 / 1.1 beats plain's 1 / 1 and K = 2's 1.36 / 1.2
    assert best_k(good, steep) == 0  # never below plain decoding
    assert best_k([0.0] * 4, flat) == 0
    # K = 2 gives 2.62 / 1.2 = 2.183 tokens per unit, K = 3 2.692 / 1.3 = 2.071 (5.4% less): K = 3 is kept
    # unless 2 is more than `margin` faster
    middle = [0.9, 0.8, 0.1, 0.1]
    assert best_k(middle, flat) == 2
    assert best_k(middle, flat, current=3, margin=0.1) == 3
    assert best_k(middle, flat, current=3, margin=0.01) == 2
    # K = 1 at 1.8 tokens per 1.76 units is 2.3% faster than plain: within `plain_margin`, so plain
    close = StepTimes(verify=(1.0, 1.7, 2.4), draft=(0.0, 0.06, 0.12))
    assert best_k([0.8, 0.8], close) == 0
    assert best_k([0.8, 0.8], close, plain_margin=0.02) == 1


def test_acceptance_average_observes_the_positions_tried():
    average = AcceptanceAverage(3, prior=0.5, weight=0.5)
    average.observe(drafted=3, accepted=1)  # draft 1 accepted, draft 2 rejected, draft 3 never judged
    assert average.rates == [0.75, 0.25, 0.5]
    average.observe(drafted=1, accepted=1)  # only position 1 was tried
    assert average.rates == [0.875, 0.25, 0.5]
    average.observe(drafted=0, accepted=0)  # a plain step tells nothing
    assert average.rates == [0.875, 0.25, 0.5]


def test_untried_positions_drift_back_to_the_prior():
    average = AcceptanceAverage(3, prior=0.8, weight=0.5, relax=0.5)  # drift 1 - 0.5^count
    average.observe(drafted=3, accepted=0)  # draft 1 rejected
    assert average.rates == [0.4, 0.8, 0.8]
    average.untried(0, count=1)  # a plain step: every position drifts
    assert average.rates == pytest.approx([0.6, 0.8, 0.8])
    average.observe(drafted=2, accepted=1)
    assert average.rates == pytest.approx([0.8, 0.4, 0.8])
    average.untried(1, count=2)  # a K = 1 step of two requests: only positions 2 and 3 drift, 3/4 of the way
    assert average.rates == pytest.approx([0.8, 0.7, 0.8])


def test_k_policy_drafts_again_after_a_stretch_of_poor_acceptance():
    """The shape of 27B bf16 at B32 on an H100 (plain 23.8 ms, K = 3 37.6 ms): a burst of rejected drafts (as
    from random text) makes plain decoding the best; once the text is predictable again (every draft accepted
    with probability 0.8) the policy must come back to K = 3 instead of staying plain because plain steps
    observe nothing."""
    times = StepTimes(verify=(23.8, 27.0, 31.0, 35.0), draft=(0.0, 0.9, 1.8, 2.6))
    policy = KPolicy(3, [32], lambda bucket: times)
    for _ in range(100):
        policy.observe(drafted=3, accepted=0)
    assert policy.choose(32) == 0
    pattern = itertools.cycle([3, 3, 1, 3, 0, 3, 2, 3, 3, 3])  # accepted drafts of a request, 0.8-ish per position
    chosen = []
    for _ in range(400):
        k = policy.choose(32)
        policy.stepped(k, 32)
        for _ in range(32 if k else 0):
            policy.observe(drafted=k, accepted=min(k, next(pattern)))
        chosen.append(k)
    assert chosen[0] == 0 and chosen[-1] == 3
    assert chosen.index(3) < 200


def test_k_policy_measures_each_bucket_once_and_picks_by_batch():
    measured = []
    fast = StepTimes((1.0,) * 3, (0.0, 0.1, 0.2))
    slow = StepTimes((1.0, 3.0, 5.0), (0.0, 0.1, 0.2))

    def times_of(bucket):
        measured.append(bucket)
        return fast if bucket <= 2 else slow

    policy = KPolicy(2, [1, 2, 4], times_of)
    assert policy.choose(1) == 2 and policy.choose(3) == 0 and policy.choose(2) == 2 and policy.choose(4) == 0
    assert measured == [1, 4, 2]


# ---- the engine -----------------------------------------------------------------------------------------------
SCRIPTS = {
    "down-and-up": [3, 3, 1, 0, 0, 2, 3, 0, 1, 3],
    "zeros-between": [0, 3, 0, 2, 0, 1],
}


@pytest.mark.parametrize("params", [greedy, sampled], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", ["head", "oracle"])
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripted_k_per_step_equals_plain(checkpoint, script, draft, params):
    path = checkpoint("tiny")
    expected = run(cpu_engine(path), params)
    engine = cpu_engine(path, "auto", max_k=3, draft=draft, oracle_accept=0.8)
    engine.speculator.policy = policy = Scripted(SCRIPTS[script])
    assert run(engine, params, oracles=expected if draft == "oracle" else None) == expected
    assert {0, 1, 3} <= set(policy.used)
    if draft == "oracle" and script == "down-and-up":  # many accepted drafts: truncation and fillers mattered
        assert engine.stats()["accepted"] > 20
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["free_state_rows"] == stats["total_state_rows"]


@pytest.mark.parametrize("params", [greedy, sampled], ids=["greedy", "sampled"])
def test_real_policy_equals_plain(checkpoint, params):
    """The real policy over measured (CPU, eager) step times; and over given times that make it change K with
    the batch (K = 3 for 1-2 requests, K = 0 for 3 or more) while requests end one after another."""
    path = checkpoint("tiny")
    expected = run(cpu_engine(path), params)
    engine = cpu_engine(path, "auto", max_k=3)
    engine.warmup()  # measures every bucket's step times on padding rows
    policy = engine.speculator.policy
    assert sorted(policy.times) == policy.buckets == [1, 2, 4, 8]
    assert run(engine, params) == expected

    def shrinking(i):  # prompt i stops 2 tokens before prompt i - 1: the batch shrinks step by step
        return dataclasses.replace(params(i), max_new_tokens=MAX_NEW - i)

    want = run(cpu_engine(path), shrinking)
    engine = cpu_engine(path, "auto", max_k=3, draft="oracle", oracle_accept=0.9)
    policy = engine.speculator.policy
    cheap, dear = StepTimes((1.0,) * 4, (0.0, 0.1, 0.2, 0.3)), StepTimes((1.0, 3.0, 5.0, 7.0), (0.0, 0.1, 0.2, 0.3))
    policy.times = {1: cheap, 2: cheap, 4: dear, 8: dear}
    chosen, choose = [], policy.choose
    policy.choose = lambda count: chosen.append((count, choose(count))) or chosen[-1][1]
    assert run(engine, shrinking, oracles=want) == want
    assert {k for count, k in chosen if count >= 3} == {0} and {k for count, k in chosen if count <= 2} == {3}
    # what an operator sees (Engine.stats(), the server's /metrics): the last step's K (one or two requests: 3)
    # and the estimates the policy weighs
    stats = engine.stats()
    assert stats["step_k"] == 3 and stats["k_auto_acceptance"] == policy.acceptance.rates
    metrics = ServerMetrics()
    metrics.watch(engine.stats, lambda: 0)
    text = metrics.exposition().decode()
    assert "qwen_mtp_spec_step_k 3.0" in text
    for position, rate in enumerate(policy.acceptance.rates, start=1):
        assert f'qwen_mtp_spec_k_auto_acceptance{{position="{position}"}} {rate!r}' in text


def test_steps_chain_while_k_stays(checkpoint, monkeypatch):
    """With `cache.lookahead` (on by default) a step whose K is the K of the step in flight is launched before
    that one is read, K = 0 steps included; a change of K waits for the read. The tokens stay plain decoding's,
    and each verify's acceptance counts the real drafts it checked: a step after a rise of K checks fewer than K
    (fillers), and the chained step launched before its read must not change that count."""
    path = checkpoint("tiny")

    def longer(i):
        return dataclasses.replace(greedy(i), max_new_tokens=40)

    expected = run(cpu_engine(path), longer)
    engine = cpu_engine(path, "auto", max_k=3, draft="oracle", oracle_accept=0.8)
    engine.speculator.policy = Scripted([1, 3, 3, 3, 3, 0, 0, 0, 0, 2])
    verifies, verify = [], engine.speculator._verify

    def recorded(batch, drafted, shift=None):
        verifies.append((batch.token_ids.shape[1] - 1, drafted, shift is not None))  # K, real drafts, chained
        return verify(batch, drafted, shift)

    monkeypatch.setattr(engine.speculator, "_verify", recorded)
    assert run(engine, longer, oracles=expected) == expected
    assert {0, 3} <= {k for k, _, chained in verifies if chained}
    assert any(sum(drafted) < k * len(drafted) for k, drafted, _ in verifies)  # a rise of K: fillers
    assert engine.stats()["drafted"] == sum(sum(drafted) for _, drafted, _ in verifies)


def _mtp_kv(engine, request, positions):
    """The MTP layers' keys and values of `request`'s first `positions` positions [layers, 2, positions, ...]."""
    pages = engine.pages
    layers = [i for name, i in pages.layer_index.items() if name.startswith("mtp.")]
    table = pages.tables[request.id]
    slots = [table[p // pages.page_size] * pages.page_size + p % pages.page_size for p in range(positions)]
    flat = pages.storage[layers].flatten(2, 3)  # [layers, 2, pages * page_size, KV, D]
    return flat[:, :, slots]


@pytest.mark.parametrize("behind", [256, 2])
@pytest.mark.parametrize("params", [greedy, sampled], ids=["greedy", "sampled"])
def test_mtp_kv_after_plain_steps_equals_fixed_k(checkpoint, params, behind, monkeypatch):
    """Whatever K the steps used (K = 0 included), the MTP KV of every committed position is what a fixed K
    writes, up to fp32 rounding: positions a K = 0 step decoded plainly are caught up from the target's hidden
    states when K rises (or when `MAX_BEHIND` of them wait: 2 here), as one prompt-chunk pass instead of one
    catch-up per step, so later drafts (and the acceptance) are as good as with a fixed K. A position never
    caught up would hold another's values or zeros. Oracle drafts, so many are accepted and j varies."""
    monkeypatch.setattr(speculative, "MAX_BEHIND", behind)
    path = checkpoint("tiny")
    prompt, oracle = PROMPTS[3], run(cpu_engine(path), params, PROMPTS[3:4])[0]
    kv = []
    for k, script in ((3, None), ("auto", [3, 3, 0, 0, 2, 0, 0, 0, 3, 1, 0])):
        engine = cpu_engine(path, k, max_k=3, draft="oracle", oracle_accept=0.8)
        if script is not None:
            engine.speculator.policy = Scripted(script)
        request = engine.requests[
            engine.submit_with_oracle(prompt, oracle, dataclasses.replace(params(0), max_new_tokens=60))
        ]
        # read when no position is left behind (K = 0 steps caught up); a failed request ends the loop, not the test
        while request.num_computed < len(prompt) + 24 or request.id in engine.speculator._behind:
            assert engine.has_unfinished(), f"the request ended early: {engine.result(request.id).finish_reason}"
            engine.step()
        kv.append(_mtp_kv(engine, request, len(prompt) + 24))
    torch.testing.assert_close(kv[1], kv[0], rtol=1e-5, atol=1e-5)


def test_plain_steps_run_no_mtp_work(checkpoint, monkeypatch):
    """A K = 0 step runs the target alone: the MTP head runs only when K rises again (one catch-up pass)."""
    path = checkpoint("tiny")
    engine = cpu_engine(path, "auto", max_k=3)
    engine.speculator.policy = Scripted([0] * 8 + [2, 2])  # a refused chain takes one 2, the next step the other
    calls = []
    for name in ("draft", "prefill_mtp"):
        original = getattr(engine.runner, name)
        monkeypatch.setattr(engine.runner, name, lambda *a, _n=name, _o=original: calls.append(_n) or _o(*a))
    request = engine.requests[engine.submit(PROMPTS[3], greedy(0))]
    while "draft" not in calls and engine.has_unfinished():
        engine.step()
    # the prompt's three 16-token chunks, then nothing for the K = 0 steps (chained ones among them), then the
    # K = 2 step: one catch-up pass over their positions and the step's own draft
    assert calls == ["prefill_mtp"] * 4 + ["draft"]
    assert engine.lookahead_steps > 0
    assert request.id not in engine.speculator._behind


def test_compiled_buckets_with_k_per_step_equal_plain(checkpoint):
    """The static decode path (torch.compile, aot_eager on CPU) with K changing per step: one target and one
    draft step per (bucket, K), MTP-on == MTP-off; warm-up builds them all and times each bucket."""
    path = checkpoint("tiny")
    recipe = {
        "model": {"path": str(path), "dtype": "float32", "device": "cpu"},
        "cache": {"max_batch": 4, "prefill_chunk": 16},
        "compile": {"enabled": True, "backend": "aot_eager", "batch_sizes": [2, 4]},
    }
    prompts = PROMPTS[:4]
    expected = run(Engine.from_recipe(recipe, log=lambda _: None), greedy, prompts)
    engine = Engine.from_recipe(recipe | {"mtp": {"enabled": True, "k": "auto", "max_k": 2}}, log=lambda _: None)
    engine.warmup()
    steps = sorted(engine.runner.graphs._steps)
    assert steps == sorted((kind, size, k + 1) for kind in ("draft", "target") for size in (2, 4) for k in range(3))
    assert sorted(engine.speculator.policy.times) == [2, 4]
    engine.speculator.policy = Scripted([2, 0, 1, 2, 0, 0, 2])
    assert run(engine, greedy, prompts) == expected
    assert sorted(engine.runner.graphs._steps) == steps  # nothing built after the warm-up


def test_step_times_are_measured_on_tokens_spread_over_the_vocabulary(checkpoint):
    """The padding rows that time each (bucket, K) hold distinct tokens wherever the vocabulary allows, so an
    MoE verify is timed routing to many experts as real traffic does (one token everywhere routed every row and
    position to the same experts, and K: auto took a large K for cheap)."""
    ids = spread_tokens(32, 5, 248_320)
    assert ids.shape == (32, 5) and ids.unique().numel() == 160 and 0 <= int(ids.min()) and int(ids.max()) < 248_320
    assert spread_tokens(9, 5, 40).unique().numel() == 40  # more rows than tokens: every token used
    engine = cpu_engine(checkpoint("tiny"), "auto", max_k=3)
    batch = engine.speculator._padding_batch(8, 4)
    vocab = engine.runner.model.shapes.vocab_size
    assert batch.token_ids.unique().numel() == min(32, vocab) and int(batch.token_ids.max()) < vocab


def test_step_times_are_measured_with_the_state_traffic_of_the_batch():
    """Each padding row that times a step has a state row of its own where free rows allow (on one shared row,
    a large batch's verify read and wrote one request's state from L2 and was timed far cheaper than it runs):
    free rows first, never a row a request owns, then the scratch row; a row handed to a request is zeroed."""
    states = StatePool(["gdn"], 4, 3, 4, 1, 2, 2, 1, torch.float32, torch.float32, "cpu")
    owned = states.allocate(request=7)
    rows = states.timing_rows(6)
    assert len(set(rows[:3])) == 3 and owned not in rows and rows[3:] == [states.scratch_row] * 3
    states.ssm[:, rows[0]] = 1.0  # what a timed step leaves behind
    assert states.ssm[:, states.allocate(request=8)].abs().sum() == 0


def test_catch_up_of_several_requests_is_one_packed_pass(checkpoint, monkeypatch):
    """When K rises, the positions K = 0 steps left behind are caught up for every request at once: one packed MTP
    pass over all their spans and one draft chain (one host read), not a pass, a chain and a read per request. The
    MTP KV and the drafts it makes equal catching each request up on its own (the KV up to fp32 rounding: the
    packed linears run row by row)."""
    path = checkpoint("tiny")
    prompts = PROMPTS[:4]
    runs = []
    for alone in (False, True):
        engine = cpu_engine(path, "auto", max_k=3)
        engine.speculator.policy = Scripted([2, 0, 0, 0, 0, 3, 3, 0, 0, 1])
        passes, drafts, spans, catch_up = [], [], engine.runner.prefill_mtp_spans, engine.speculator._catch_up
        monkeypatch.setattr(
            engine.runner, "prefill_mtp_spans", lambda s, _f=spans, _p=passes: _p.append(len(s)) or _f(s)
        )

        def caught_up(requests, draft, _f=catch_up, _alone=alone, _drafts=drafts):
            for group in [[r] for r in requests] if _alone else [requests]:
                _f(group, draft)
            if draft and requests:
                _drafts.append({r.id: list(r.drafts) for r in requests})

        monkeypatch.setattr(engine.speculator, "_catch_up", caught_up)
        params = dataclasses.replace(greedy(0), max_new_tokens=60)
        requests = [engine.requests[engine.submit(p, params)] for p in prompts]
        # read while every request runs, once no position is behind
        while any(r.num_computed < len(r.prompt) + 20 or r.id in engine.speculator._behind for r in requests):
            assert engine.has_unfinished(), "the requests ended early"
            engine.step()
        assert max(passes) == (1 if alone else len(prompts)), passes  # K = 0 steps ran for all four at once
        runs.append((drafts, [_mtp_kv(engine, r, len(r.prompt) + 20) for r in requests]))
    (drafts, kv), (drafts_alone, kv_alone) = runs
    assert drafts and drafts == drafts_alone
    for ours, theirs in zip(kv, kv_alone, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
