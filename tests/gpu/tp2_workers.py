"""What the two NCCL ranks of tests/gpu/test_tp2.py run (spawned processes import this module)."""

from __future__ import annotations

import json
from pathlib import Path

from qwen_mtp.engine import Engine
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
