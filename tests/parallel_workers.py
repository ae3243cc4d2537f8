"""What the two gloo ranks of tests/test_parallel.py run: the tiny checkpoints' generations (MTP off and on, a busy
engine, constrained, compiled), the trained model's draft heads, `k: auto` and sampled requests, a prefix-cached
conversation, then the dead-rank check. Spawned processes import this module (not the test module, which pulls in
transformers): one spawn serves every check, since a spawn costs seconds."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import torch
from prefix_helpers import converse

from qwen_mtp.engine import Engine, SamplingParams, StructuredOutput
from qwen_mtp.engine.k_policy import StepTimes
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.parallel import current
from qwen_mtp.parallel.collectives import all_reduce_sum, sum_in_rank_order
from qwen_mtp.parallel.vocab import VocabShard
from qwen_mtp.recipe import load_recipe

# the structured output of the constrained generations (every token masked, on both ranks' shards)
STRUCTURED_REGEX = r"[0-9]{2,5}-[a-z]+( [a-z]+)*"

TP = 2


def quiet(message: str) -> None:
    pass


def tp_checks(spec_file: str) -> None:
    """Run the spec's generations at TP=2 and write this rank's tokens to `rank<r>.json`; then the dead-rank
    check: rank 1 kills itself mid-generation and rank 0, still generating, must exit on its own."""
    spec = json.loads(Path(spec_file).read_text())
    out = Path(spec["out"])
    parallel = current(TP)
    rank = parallel.rank
    err = os.open(out / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # the launcher's messages (a failed rank's report) land here for the test to read
    results = {"vocab_argmax": vocab_argmax_cases(parallel), "sum_in_rank_order": rank_order_sum_case(parallel)}
    for name, path in spec["checkpoints"].items():
        results[name] = generations(path, spec["prompts"], spec["max_new_tokens"], name == spec["compiled"])
    results["draft_heads"] = draft_head_runs(spec["small_model"], spec["small_prompts"], TP)
    results["k_auto"] = k_auto(spec["small_model"], spec["small_prompts"], rank)
    results["sampled"] = sampled_runs(spec["small_model"], spec["small_prompts"], TP)
    results["prefix_cache"] = prefix_cached(spec["checkpoints"][spec["compiled"]], spec["turns"])
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dead_rank(path, out, rank)


def vocab_argmax_cases(parallel) -> list[list[int]]:
    """Greedy choices over a vocab split in two, ties across and within the shards included, next to
    `torch.argmax` over the whole row."""
    full = torch.zeros(4, 8)
    full[0, [2, 6]] = 5.0  # a tie across the shards: the lowest id (2, on rank 0)
    full[1, [5, 7]] = 5.0  # a tie within rank 1's shard: its lowest id (5)
    full[2, 6], full[2, 1] = 3.0, 2.5  # rank 1 holds the maximum
    full[3] = -1.0  # every logit equal: id 0
    shard = VocabShard(parallel.rank * 4, parallel.group)
    chosen = shard.argmax(full[:, parallel.rank * 4 : (parallel.rank + 1) * 4])
    return [chosen.tolist(), full.argmax(dim=-1).tolist()]


def rank_order_sum_case(parallel) -> bool:
    """The decode path's rank-order sum (used from 3 ranks on) equals the all-reduce at 2 ranks, bit for bit."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(parallel.rank))
    return bool(torch.equal(sum_in_rank_order(x, parallel.group), all_reduce_sum(x, parallel.group)))


def generations(path: str, prompts: list[list[int]], max_new_tokens: int, compiled: bool) -> dict[str, list]:
    """TP=2 tokens: MTP off, MTP K=2 (batched, then each prompt alone) and, if `compiled`, MTP K=2 through
    torch.compile (aot_eager: the collectives traced inside full graphs; ~10 s, so for one checkpoint only)."""
    base = {
        "model": {"path": path, "device": "cpu", "dtype": "float32"},
        "parallel": {"tp": TP},
        "cache": {"prefill_chunk": 16, "max_batch": 4},
    }
    recipe = load_recipe(base)
    loaded = load_from_recipe(recipe)

    def run(prompts, mtp=False, compiled=False, params=None):
        variant = dataclasses.replace(
            recipe,
            mtp=dataclasses.replace(recipe.mtp, enabled=mtp, k=2),
            compile=dataclasses.replace(recipe.compile, enabled=compiled, backend="aot_eager", batch_sizes=[4]),
        )
        engine = Engine.from_recipe(variant, loaded=loaded, log=quiet)
        params = params or SamplingParams(max_new_tokens, ignore_eos=True)
        return [r.token_ids for r in engine.generate(prompts, params)]

    def busy() -> list[list[int]]:
        """MTP K=3 (the lookahead chains steps) on two state rows, the prompts arriving a step apart, the second
        cancelled mid-generation and submitted again: each prompt's tokens, as a server would return them."""
        variant = dataclasses.replace(
            recipe,
            mtp=dataclasses.replace(recipe.mtp, enabled=True, k=3),
            cache=dataclasses.replace(recipe.cache, max_batch=2, num_state_rows=2),
        )
        engine = Engine.from_recipe(variant, loaded=loaded, log=quiet)
        params = SamplingParams(max_new_tokens, ignore_eos=True)
        ids, step = {}, 0
        while step < len(prompts) or engine.has_unfinished():
            if step < len(prompts):
                ids[step] = engine.submit(prompts[step], params)
            if step == 3:  # the second prompt, by now decoding: cancelled, then admitted again from scratch
                engine.cancel(ids[1])
                ids[1] = engine.submit(prompts[1], params)
            engine.step()
            step += 1
        return [engine.result(ids[i]).token_ids for i in range(len(prompts))]

    structured = SamplingParams(max_new_tokens, structured=StructuredOutput(regex=STRUCTURED_REGEX))
    tokens = {
        "off": run(prompts),
        "busy": busy(),
        "mtp": run(prompts, mtp=True),
        "mtp_alone": [run([p], mtp=True)[0] for p in prompts],
        "constrained_off": run(prompts, params=structured),  # each rank masks its own vocabulary ids
        "constrained_mtp": run(prompts, mtp=True, params=structured),
    }
    if compiled:
        tokens["mtp_compiled"] = run(prompts, mtp=True, compiled=True)
    return tokens


# The MTP section's draft head fields. The first 200 ids all lie on rank 0 (rank 1 scores none); the model's 1,024
# most frequent ids (its count file) lie on both, scattered (925 and 99).
COUNTS = str(Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small" / "draft_vocab.tsv")
DRAFT_HEADS = {
    "every_id": dict(draft_vocab=4096, draft_vocab_file="first"),
    "rank0_ids": dict(draft_vocab=200, draft_vocab_file="first"),
    "counted_ids": dict(draft_vocab=1024, draft_vocab_file=COUNTS),
    "fp8": dict(draft_lm_head="fp8"),
    "fp8_counted_ids": dict(draft_vocab=1024, draft_vocab_file=COUNTS, draft_lm_head="fp8"),
}


def draft_head_runs(path: str, prompts: list[str], tp: int) -> dict[str, dict]:
    """The trained model (its drafts are accepted, so a wrong draft shows) at `tp` ranks (1: the test process's own
    reference), K=2, greedy: each draft head of `DRAFT_HEADS` (under TP on vocabulary shards: each rank scores its
    part of the draft ids, possibly none, or an FP8 copy of its shard), the plain lm_head and MTP off: each run's
    tokens and accepted draft count."""
    recipe = load_recipe({"model": {"path": path, "device": "cpu", "dtype": "float32"}, "parallel": {"tp": tp}})
    loaded = load_from_recipe(recipe)
    runs = {"off": None, "lm_head": {}, **DRAFT_HEADS}
    results = {}
    for name, drafts in runs.items():
        mtp = dataclasses.replace(recipe.mtp, enabled=drafts is not None, k=2, **(drafts or {}))
        engine = Engine.from_recipe(dataclasses.replace(recipe, mtp=mtp), loaded=loaded, log=quiet)
        params = SamplingParams(24, ignore_eos=True)
        tokens = [r.token_ids for r in engine.generate([engine.encode(p) for p in prompts], params)]
        results[name] = {"tokens": tokens, "accepted": engine.stats().get("accepted", 0)}
    return results


SAMPLED = [  # one request per prompt, each its own mix of the sampler's features
    dict(temperature=0.8, top_k=40, top_p=0.9, seed=1, logprobs=2, prompt_logprobs=1),
    dict(temperature=1.0, min_p=0.05, seed=2, repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={10: 2.0}),
    dict(temperature=0.7, seed=3, presence_penalty=0.4, min_tokens=20, logprobs=1),
]


def sampled_runs(path: str, prompts: list[str], tp: int) -> dict[str, list]:
    """The trained model at `tp` ranks, the prompts batched with `SAMPLED`'s parameters, MTP off and K=2: each
    request's tokens and logprobs (`logprobs_of`)."""
    recipe = load_recipe({"model": {"path": path, "device": "cpu", "dtype": "float32"}, "parallel": {"tp": tp}})
    loaded = load_from_recipe(recipe)
    runs = {}
    for name, enabled in (("off", False), ("mtp", True)):
        mtp = dataclasses.replace(recipe.mtp, enabled=enabled, k=2)
        engine = Engine.from_recipe(dataclasses.replace(recipe, mtp=mtp), loaded=loaded, log=quiet)
        ids = [engine.encode(p) for p in prompts]
        params = [SamplingParams(24, **fields) for fields in SAMPLED]
        rids = [engine.submit(prompt, param) for prompt, param in zip(ids, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
        results = [engine.result(rid) for rid in rids]
        runs[name] = [logprobs_of(r) for r in results]
    return runs


def logprobs_of(result) -> tuple[list[int], list[float], list[list[int]]]:
    """A result's tokens, and of each position with logprobs (prompt positions first) the chosen token's logprob
    and the ids of the most likely tokens."""
    entries = [e for e in (result.prompt_logprobs or []) if e is not None] + list(result.logprobs or [])
    return result.token_ids, [e.logprob for e in entries], [[token for token, _ in e.top] for e in entries]


def k_auto(path: str, prompts: list[str], rank: int) -> dict[str, list]:
    """`mtp.k: auto` (max_k 3) on the trained model at TP=2, each rank measuring other step times (rank 0: every K
    costs a plain step; rank 1: K = 3 costs three): alone, rank 0 would choose K = 3 and rank 1 K = 2, and their
    collectives would no longer pair. The tokens and the K of every step."""
    recipe = load_recipe({"model": {"path": path, "device": "cpu", "dtype": "float32"}, "parallel": {"tp": TP}})
    recipe = dataclasses.replace(recipe, mtp=dataclasses.replace(recipe.mtp, enabled=True, k="auto", max_k=3))
    engine = Engine.from_recipe(recipe, log=quiet)
    speculator = engine.speculator
    verify = (1.0, 1.0, 1.0, 1.0) if rank == 0 else (1.0, 1.0, 1.0, 3.0)
    speculator.measure_times = lambda bucket: StepTimes(verify, (0.0, 0.0, 0.0, 0.0))
    chosen, choose = [], speculator.policy.choose
    speculator.policy.choose = lambda count: chosen.append(choose(count)) or chosen[-1]
    params = SamplingParams(24, ignore_eos=True)
    tokens = [r.token_ids for r in engine.generate([engine.encode(p) for p in prompts], params)]
    # K = 0 while three requests run, K > 0 once two are left: their K = 0 positions caught up in one packed pass
    engine = Engine.from_recipe(recipe, log=quiet)
    speculator = engine.speculator
    cheap, dear = StepTimes((1.0,) * 4, (0.0,) * 4), StepTimes((1.0, 3.0, 5.0, 7.0), (0.0,) * 4)
    speculator.measure_times = lambda bucket: cheap if bucket <= 2 else dear
    rise, choose = [], speculator.policy.choose
    speculator.policy.choose = lambda count: rise.append(choose(count)) or rise[-1]
    lengths = (24, 16, 6)
    ids = [
        engine.submit(engine.encode(p), SamplingParams(n, ignore_eos=True))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    while engine.has_unfinished():
        engine.step()
    return {"tokens": tokens, "k": chosen, "rise_tokens": [engine.result(i).token_ids for i in ids], "rise_k": rise}


PREFIX_CHUNK = 8  # prefill chunk = page size: one page per chunk, so a short conversation spans chunks


def prefix_cached(path: str, turns: list[list[int]]) -> dict[str, object]:
    """A conversation at TP=2 with MTP K=2 (each turn's prompt: the history and its message; `converse`), cold and
    with `cache.prefix_caching` (each rank restores its own GDN heads' snapshots and KV pages); then the cache
    cleared. Per run: each turn's tokens, drafts and restored positions; the cached engine's stats."""
    runs = {}
    for caching in (False, True):
        cache = {"prefill_chunk": PREFIX_CHUNK, "page_size": PREFIX_CHUNK, "prefix_caching": caching}
        recipe = {"model": {"path": path, "device": "cpu", "dtype": "float32"}, "parallel": {"tp": TP},
                  "cache": cache, "mtp": {"enabled": True, "k": 2}}  # fmt: skip
        engine = Engine.from_recipe(recipe, log=quiet)
        runs["cached" if caching else "cold"] = converse(engine, turns, 5)
    runs["stats"] = engine.stats()
    runs["evicted"] = engine.clear_prefix_cache()
    runs["stats_cleared"] = engine.stats()
    return runs


def dead_rank(path: str, out: Path, rank: int) -> None:
    recipe = load_recipe({"model": {"path": path, "device": "cpu", "dtype": "float32"}, "parallel": {"tp": TP}})
    engine = Engine.from_recipe(recipe, log=quiet)
    engine.submit([1, 2, 3], SamplingParams(max_new_tokens=1000, ignore_eos=True))
    for _ in range(3):
        engine.step()
    if rank == 1:
        (out / "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    while engine.has_unfinished():  # fails at the next collective: rank 1 is gone
        engine.step()
