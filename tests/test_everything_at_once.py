"""Every feature at once, the way a busy server runs them: the shipped model with MTP (`k: auto`, or a fixed K with
the lookahead), a draft vocabulary, prefix caching, mixed steps (or not), under memory pressure, with seeded arrivals
of greedy, sampled, penalized, biased, stop-token, stop-string, min-tokens, logprobs, prompt-logprobs and
grammar-constrained requests that share prefixes, and cancellations followed by re-admission. Each finished request
must give exactly the tokens, finish reason, text and logprobs (bit for bit) it gets alone on a plain engine (MTP
off, no prefix cache) that prefills as the busy one does (packed or not: the two round a prompt differently,
docs/mixed-steps.md), and every page, state row and snapshot slot must come back."""

import random
from pathlib import Path

import pytest

from qwen_mtp import Engine, SamplingParams, StructuredOutput
from qwen_mtp.train.evaluate import read_prompts

SMALL = Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small"
CACHE = {"page_size": 8, "prefill_chunk": 16, "max_batch": 4, "num_state_rows": 4}
MAX_K = 3


def recipe(variant: str, mixed: bool, cache: dict) -> dict:
    """`variant`: fp32 weights and state; bf16 weights and state; FP8 block weights quantized at load (bf16)."""
    model = {"path": str(SMALL), "dtype": "float32" if variant == "fp32" else "bfloat16", "device": "cpu"}
    model["quant"] = "fp8-block" if variant == "fp8" else "none"
    state = {"dtype": "bfloat16" if variant == "bf16" else "float32"}
    return {"model": model, "state": state, "cache": {**CACHE, "mixed_steps": mixed, **cache}}


def busy_engine(variant: str, mixed: bool, k: int | str) -> Engine:
    """MTP with K drafts a step (the lookahead chains its steps), or with `k: auto`, whose K is then drawn at
    random each step (0..MAX_K): the measured policy's choice depends on timings, so the run would not be
    reproducible, and a random K meets every other feature."""
    cache = {"num_pages": 40, "prefix_caching": True, "max_step_tokens": CACHE["max_batch"] * (1 + MAX_K) + 24}
    mtp = {"enabled": True, "k": k, "max_k": MAX_K, "draft_vocab": 1024,
           "draft_vocab_file": str(SMALL / "draft_vocab.tsv")}  # fmt: skip
    engine = Engine.from_recipe({**recipe(variant, mixed, cache), "mtp": mtp}, log=lambda _: None)
    if k == "auto":
        k_rng = random.Random(7)
        engine.speculator.policy.choose = lambda count: k_rng.randint(0, MAX_K)
    return engine


def plain_engine(variant: str, mixed: bool) -> Engine:
    return Engine.from_recipe(recipe(variant, mixed, {"num_pages": 64}), log=lambda _: None)


def random_params(rng: random.Random) -> SamplingParams:
    """One request's settings, drawn so that most features meet most others somewhere in the run."""
    sampled, max_new = rng.random() < 0.6, rng.randint(1, 24)
    extra = {}
    if rng.random() < 0.15:
        extra["structured"] = StructuredOutput(regex=r"[a-z_]+\([a-z_, ]*\)\n")
    if rng.random() < 0.25:
        extra["stop_token_ids"] = (rng.choice([10, 11, 14]),)  # "(", ")", ",": frequent in the model's output
    if rng.random() < 0.3:
        extra["logprobs"] = 2
    if rng.random() < 0.1:
        extra["prompt_logprobs"] = 1
    if rng.random() < 0.2:
        extra["stop"] = (rng.choice(["):", " self", "\n\n"]),)
    if rng.random() < 0.2:
        extra["logit_bias"] = {rng.choice([10, 11, 14, 16, 65]): rng.choice([-100.0, 5.0])}  # tokens that matter
    return SamplingParams(
        max_new_tokens=max_new,
        ignore_eos=rng.random() < 0.5,
        temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
        top_k=rng.choice([0, 20]) if sampled else 0,
        top_p=rng.choice([1.0, 0.9]) if sampled else 1.0,
        min_p=rng.choice([0.0, 0.05]) if sampled else 0.0,
        seed=rng.randrange(2**31),
        min_tokens=0 if "structured" in extra else min(max_new, rng.choice([0, 0, 3])),  # a grammar forbids it
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5]),
        presence_penalty=rng.choice([0.0, 0.3]),
        **extra,
    )


@pytest.mark.parametrize(
    "variant, mixed, k, arrivals",
    [("fp32", True, "auto", 160), ("fp32", False, 2, 100), ("bf16", True, "auto", 90), ("fp8", True, 3, 70)],
    ids=["fp32-packed-k-auto", "fp32-unpacked-k2", "bf16-packed-k-auto", "fp8-packed-k3"],
)
def test_every_feature_at_once_gives_each_request_its_solo_plain_tokens(variant, mixed, k, arrivals):
    """Arrivals come during the first `arrivals` steps (fewer where the CPU path is slower: bf16, and FP8's
    per-block dequantization)."""
    engine = busy_engine(variant, mixed, k)
    rng = random.Random(2026)
    texts = read_prompts()
    prefixes = [engine.encode(texts[i]) for i in range(4)]  # shared system-prompt-like prefixes (chunks to reuse)
    submitted, cancelled, resubmitted = {}, set(), 0
    steps = 0
    while steps < arrivals or engine.has_unfinished():
        if steps < arrivals and rng.random() < 0.35:
            prompt = rng.choice(prefixes)[: rng.randint(1, 48)] + engine.encode(rng.choice(texts))[: rng.randint(0, 12)]
            params = random_params(rng)
            submitted[engine.submit(prompt, params)] = (prompt, params)
        live = [rid for rid in submitted if not engine.requests[rid].done]
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            engine.cancel(victim)
            cancelled.add(victim)
            submitted[engine.submit(*submitted[victim])] = submitted[victim]  # re-admitted: same tokens as alone
            resubmitted += 1
        engine.step()
        steps += 1
        assert steps < 2000, "the run never drained"
    stats = engine.stats()
    assert stats["free_pages"] + stats["prefix_cached_pages"] == stats["total_pages"]
    assert stats["free_state_rows"] == stats["total_state_rows"] and stats["running"] == stats["waiting"] == 0
    assert stats["prefix_free_snapshot_slots"] + stats["prefix_cached_snapshots"] == stats["prefix_snapshot_slots"]
    engine.clear_prefix_cache()
    assert engine.stats()["free_pages"] == stats["total_pages"]

    finished = {rid: submitted[rid] for rid in submitted if rid not in cancelled}
    results = {rid: engine.result(rid) for rid in finished}
    assert len(finished) >= arrivals // 6 and resubmitted >= 2
    assert sum(r.cached_tokens > 0 for r in results.values()) >= 3, "the prefix cache was never hit"
    assert sum(r.spec.verify_steps for r in results.values() if r.spec) > 0
    assert k == "auto" or engine.lookahead_steps > 0  # (`k: auto` does not chain its steps: speculative.py)
    assert any(params.structured for _, params in finished.values())
    assert {r.finish_reason for r in results.values()} >= {"stop", "length"}
    reference = plain_engine(variant, mixed)
    for rid, (prompt, params) in finished.items():
        [expected] = reference.generate([prompt], params)
        got = results[rid]
        assert (got.token_ids, got.finish_reason, got.logprobs, got.prompt_logprobs, got.text) == (
            expected.token_ids,
            expected.finish_reason,
            expected.logprobs,
            expected.prompt_logprobs,
            expected.text,
        ), f"request {rid} ({params}) differs from its solo plain run"
