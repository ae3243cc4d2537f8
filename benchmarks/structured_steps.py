"""What a constrained step costs: decode step times of a batch whose every request has a structured output, against
the same batch free, MTP off and MTP at K with oracle drafts (MTP-off's tokens accepted at `--accept`), every MTP
run checked against MTP-off. A constrained step's masks are computed on the host from the tokens of the step before
it, so it is never launched ahead (`cache.lookahead`), and they are applied on the device (`sampling.choose`); the
step time holds all three costs, and `masks ms` the host's part (`Grammars.masks`, timed where the runner calls it).

The grammars are open-ended (one line of printable text; JSON records one a line, as many as fit), so a request runs
its whole length unless the model picks EOS where the grammar allows it. A synthetic model (the bench recipes') has no
tokenizer, and a grammar is compiled against one: the shipped model's (`--tokenizer`, models/qwen-mtp-small) is
widened with random printable tokens up to the model's vocabulary (`grammar_masks.widened_tokenizer`), so the masks
walk 248k tokens at 27B, though not Qwen's own.

    python benchmarks/structured_steps.py recipes/bench-27b.yaml [--set KEY=VALUE ...] [--batch 1 8 32] [--k 3]
        [--accept 0.8] [--tokens 64] [--out structured-steps.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
from grammar_masks import widened_tokenizer

from qwen_mtp import Engine, StructuredOutput
from qwen_mtp.bench import row_recipe, timed_batch
from qwen_mtp.engine.setup import load_from_recipe, load_tokenizer
from qwen_mtp.recipe import load_recipe

GRAMMARS = {
    "free": None,
    "regex line": StructuredOutput(regex=r"[ -~]+"),
    "json lines": StructuredOutput(regex=r'(\{"id": [0-9]{1,4}, "name": "[a-z]{1,8}"\}\n)+'),  # records, no end
}


class MaskTimer:
    """Wraps a runner's `Grammars.masks`: the host seconds its calls took, in total."""

    def __init__(self, grammars):
        self.masks, self.seconds, self.calls = grammars.masks, 0.0, 0
        grammars.masks = self

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.masks(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


def tokenizer_for(checkpoint: Path, vocab: int):
    """The checkpoint's tokenizer, widened to `vocab` tokens where it has fewer."""
    tokenizer = load_tokenizer(checkpoint)
    if len(tokenizer) >= vocab:
        return tokenizer
    with tempfile.TemporaryDirectory() as folder:
        return widened_tokenizer(checkpoint, vocab, Path(folder))


def timed_run(recipe, loaded, prompts, tokens: int, structured, oracles=None) -> dict:
    """One engine of `recipe` on `prompts`, warmed up on other prompts first (graphs captured, kernels compiled)."""
    engine = Engine.from_recipe(recipe, loaded=loaded, log=lambda _: None)
    engine.warmup()
    sampled = {} if structured is None else {"structured": structured}
    warm = [[(t + 1) % len(loaded.tokenizer) for t in prompt] for prompt in prompts]
    timed_batch(engine, warm, 3, None if oracles is None else [o[:3] for o in oracles], sampled)
    timer = MaskTimer(engine.runner.grammars)
    engine.timer.enabled = False
    result = timed_batch(engine, prompts, tokens, oracles, sampled)
    steps = max(result["decode_steps"], 1)
    return {
        "tokens": result["tokens"],
        "step_ms": 1e3 * result["decode_seconds"] / steps,
        "tpot_ms": 1e3 * result["tpot"],
        "tokens_per_s": sum(result["decode_tokens"]) / result["decode_seconds"],
        "acceptance_length": result["acceptance_length"],
        "masks_ms_per_step": 1e3 * timer.seconds / steps,
        "mask_calls": timer.calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", action="append", default=[], help="a recipe override, KEY=VALUE")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--accept", type=float, default=0.8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--grammars", nargs="+", default=list(GRAMMARS), choices=list(GRAMMARS))
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small"))
    parser.add_argument("--out", default="structured-steps.json")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, [*args.set, f"bench.output_len={args.tokens}"])  # the pools hold --tokens
    plain_recipe = dataclasses.replace(recipe, mtp=dataclasses.replace(recipe.mtp, enabled=False))
    loaded = load_from_recipe(plain_recipe, progress=False)
    loaded = dataclasses.replace(loaded, tokenizer=tokenizer_for(Path(args.tokenizer), loaded.model.config.vocab_size))
    prompt_len = recipe.bench.prompt_lens[0]
    generator = torch.Generator().manual_seed(recipe.model.seed)
    report = {"recipe": recipe.to_dict(), "k": args.k, "accept": args.accept, "tokens": args.tokens, "rows": []}
    print(f"{'B':>3s} {'grammar':12s} {'plain ms':>9s} {'K=' + str(args.k) + ' step':>10s} {'TPOT ms':>8s} "
          f"{'x plain':>8s} {'AL':>5s} {'masks ms':>9s} {'x free':>7s}  exact")  # fmt: skip
    for batch in args.batch:
        prompts = torch.randint(0, len(loaded.tokenizer), (batch, prompt_len), generator=generator).tolist()
        free_step = None
        for name in args.grammars:
            structured = GRAMMARS[name]
            plain = timed_run(row_recipe(recipe, prompt_len, batch, None), loaded, prompts, args.tokens, structured)
            mtp_recipe = row_recipe(recipe, prompt_len, batch, args.k, "oracle", args.accept)
            mtp = timed_run(mtp_recipe, loaded, prompts, args.tokens, structured, oracles=plain["tokens"])
            exact = mtp["tokens"] == plain["tokens"]
            free_step = mtp["step_ms"] if structured is None else free_step
            vs_free = mtp["step_ms"] / free_step if free_step else float("nan")
            speedup = mtp["tokens_per_s"] / plain["tokens_per_s"]
            print(f"{batch:3d} {name:12s} {plain['step_ms']:9.2f} {mtp['step_ms']:10.2f} {mtp['tpot_ms']:8.2f} "
                  f"{speedup:8.2f} {mtp['acceptance_length']:5.2f} {mtp['masks_ms_per_step']:9.3f} {vs_free:7.2f}  "
                  f"{exact}", flush=True)  # fmt: skip
            report["rows"].append({
                "batch": batch, "grammar": name, "exact": exact, "speedup": speedup, "mtp_step_vs_free": vs_free,
                "plain": {k: v for k, v in plain.items() if k != "tokens"},
                "mtp": {k: v for k, v in mtp.items() if k != "tokens"},
            })  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
