"""What the two NCCL ranks of tests/gpu/test_tp2.py run (spawned processes import this module)."""

from __future__ import annotations

import json
from pathlib import Path

import parallel_workers

from qwen_mtp.engine import Engine, SamplingParams
from qwen_mtp.engine.setup import load_from_recipe
from qwen_mtp.parallel import current
from qwen_mtp.recipe import load_recipe


def tp2_exactness(spec_file: str) -> None:
    """At TP=2 on two GPUs (bf16, CUDA graphs; torch.compile too when the spec asks): MTP K=1..3 with oracle
    drafts gives the plain tokens at batch 1 and 8; each rank writes its tokens to rank<r>.json."""
    spec = json.loads(Path(spec_file).read_text())
    rank = current(2).rank
    recipe = load_recipe(spec["recipe"])
    loaded = load_from_recipe(recipe)
    results = {}
    for batch in (1, 8):
        prompts = spec["prompts"][:batch]
        for k in (None, 1, 2, 3):
            variant = dict(spec["recipe"])
            variant["cache"] = {"max_batch": 8, "num_state_rows": 8, "num_pages": 512}
            if k is not None:
                variant["mtp"] = {"enabled": True, "k": k, "draft": "oracle", "oracle_accept": 0.8}
            engine = Engine.from_recipe(variant, loaded=loaded, log=lambda _: None)
            tokens = engine.generate(prompts, max_new_tokens=spec["max_new_tokens"], ignore_eos=True)
            results[f"b{batch}-k{k or 0}"] = [r.token_ids for r in tokens]
            del engine
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(results))


# tp2_features: one request per prompt, each its own mix of the sampler's features (the CPU test's, and a greedy
# request beside them)
SAMPLED = [*parallel_workers.SAMPLED, {}]
FEATURE_RUNS = {  # the MTP section of each run (None: MTP off)
    "off": None,
    "k2": {"enabled": True, "k": 2},
    "k2_draft_vocab": {"enabled": True, "k": 2, "draft_vocab": 1024, "draft_vocab_file": "first"},
    "k2_fp8_draft_lm_head": {"enabled": True, "k": 2, "draft_lm_head": "fp8"},
    "auto": {"enabled": True, "k": "auto", "max_k": 3},
}


def tp2_features(spec_file: str) -> None:
    """At TP=2 on two GPUs (the spec's recipe: the shipped model, CUDA graphs): sampled, penalized and greedy
    requests with logprobs batched together under each MTP variant of `FEATURE_RUNS` (draft vocabulary, FP8 draft
    lm_head, k: auto), then a conversation cold and with prefix caching; each rank writes rank<r>.json."""
    spec = json.loads(Path(spec_file).read_text())
    rank = current(2).rank
    recipe = load_recipe(spec["recipe"])
    loaded = load_from_recipe(recipe)
    results = {}
    for name, mtp in FEATURE_RUNS.items():
        variant = dict(spec["recipe"]) | ({"mtp": mtp} if mtp else {})
        engine = Engine.from_recipe(variant, loaded=loaded, log=lambda _: None)
        rids = [
            engine.submit(engine.encode(text), SamplingParams(spec["max_new_tokens"], **fields))
            for text, fields in zip(spec["texts"], SAMPLED, strict=True)
        ]
        while engine.has_unfinished():
            engine.step()
        results[name] = [parallel_workers.logprobs_of(engine.result(rid)) for rid in rids]
        del engine
    for caching in (False, True):  # greedy, MTP K=2: each turn's prompt is the history and a new message
        variant = dict(spec["recipe"]) | {"mtp": {"enabled": True, "k": 2}}
        variant["cache"] = {"prefix_caching": caching, "prefill_chunk": 64, "page_size": 16}
        engine = Engine.from_recipe(variant, loaded=loaded, log=lambda _: None)
        history, turns = [], []
        for text in spec["texts"]:
            prompt = history + engine.encode(text)
            [result] = engine.generate([prompt], max_new_tokens=spec["max_new_tokens"], ignore_eos=True)
            turns.append(result.token_ids)
            history = prompt + result.token_ids
        results["prefix_cached" if caching else "prefix_cold"] = turns
        results["prefix_hits"] = engine.stats().get("prefix_hits", 0)
        del engine
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(results))
