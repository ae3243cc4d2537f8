"""Measurements of a trained model: held-out losses (perplexity, the MTP head's loss and teacher-forced draft
acceptance) and MTP acceptance lengths K=1..4 when generating greedily from held-out prompts with the engine.

The acceptance prompts are a fixed file (`heldout_prompts.json` beside this module), cut from held-out files
of the Python 3.11 standard library by `heldout_prompts`: the standard library differs between Python versions,
so tests and docs read the committed file, never the local stdlib.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qwen_mtp.model import QwenHybridForCausalLM
from qwen_mtp.train.corpus import Corpus
from qwen_mtp.train.loss import joint_loss

PROMPTS_FILE = Path(__file__).with_name("heldout_prompts.json")


@torch.no_grad()
def heldout_losses(
    model: QwenHybridForCausalLM, tokens: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int, chain: int = 1
) -> dict[str, Any]:
    """Mean next-token CE (and perplexity) over consecutive held-out windows of `seq_len`, up to `max_tokens`
    predicted tokens; with an MTP head also its CE for token t+2 (and for the chained steps when `chain` > 1)
    and its teacher-forced draft acceptance."""
    device = model.lm_head_weight.device
    count = max(1, min((len(tokens) - 1 - chain) // seq_len, max_tokens // seq_len))
    starts = [i * seq_len for i in range(count)]
    sums: dict[str, float] = {}
    for first in range(0, count, batch_size):
        chunk = starts[first : first + batch_size]
        windows = torch.stack([tokens[s : s + seq_len + 1 + chain] for s in chunk]).long().to(device)
        _, parts = joint_loss(model, windows, 1.0, chain, with_mtp=model.mtp is not None)
        for key, value in parts.items():
            sums[key] = sums.get(key, 0.0) + float(value) * len(chunk)
    result: dict[str, Any] = {"tokens": count * seq_len, "lm_loss": sums["lm"] / count}
    result["perplexity"] = math.exp(result["lm_loss"])
    for key, name in (("mtp", "mtp_loss"), ("mtp_chain", "mtp_chain_loss"), ("draft_acc", "draft_acc")):
        if key in sums:
            result[name] = sums[key] / count
    return result


def heldout_prompts(count: int = 40, lines: int = 6, corpus: Corpus | None = None) -> list[str]:
    """`count` prompts from held-out files: the first `lines` lines of a function (from its `def`), one
    function per file, files in path order, then a second function per file if more are needed."""
    files = (corpus or Corpus()).files("heldout")
    per_file: list[list[str]] = []
    for file in files:
        text_lines = file.text.splitlines()
        starts = [i for i, line in enumerate(text_lines) if line.lstrip().startswith("def ")]
        per_file.append(["\n".join(text_lines[i : i + lines]) + "\n" for i in starts if i + lines <= len(text_lines)])
    prompts: list[str] = []
    for round_ in range(max(map(len, per_file), default=0)):
        for candidates in per_file:
            if round_ < len(candidates) and len(prompts) < count:
                prompts.append(candidates[round_])
    return prompts


def read_prompts(path: Path | None = None) -> list[str]:
    return json.loads((path or PROMPTS_FILE).read_text(encoding="utf-8"))["prompts"]


def measure_acceptance(
    checkpoint: str | Path,
    prompts: list[str],
    ks: tuple[int, ...] = (1, 2, 3, 4),
    max_new_tokens: int = 64,
    device: str = "cpu",
    dtype: str = "float32",
    max_batch: int = 8,
    log: Callable[[str], None] | None = None,
    draft_vocab: int = 0,
    draft_vocab_file: str | None = None,
    draft_lm_head: str = "bf16",
) -> dict[str, Any]:
    """Greedy generation from each prompt with MTP off, then with MTP K for each K in `ks` (EOS ignored, so
    every prompt generates `max_new_tokens`): acceptance lengths, per-position acceptance, and whether each
    K's tokens equal MTP-off's (they must: speculation is lossless). `draft_vocab` > 0: the head drafts from
    that many ids of `draft_vocab_file` (`mtp.draft_vocab`); `draft_lm_head` "fp8": through an FP8 copy of the
    lm_head (`mtp.draft_lm_head`)."""
    from qwen_mtp.engine import Engine
    from qwen_mtp.engine.setup import load_from_recipe
    from qwen_mtp.recipe import CacheSection, MTPSection, load_recipe

    quiet = log or (lambda _: None)
    recipe = load_recipe({"model": {"path": str(checkpoint), "dtype": dtype, "device": device}})
    loaded = load_from_recipe(recipe)
    cache = CacheSection(max_batch=max_batch)

    def generate(mtp: MTPSection) -> tuple[list[list[int]], Any]:
        engine = Engine(loaded, mtp=mtp, cache=cache, log=quiet)
        ids = [engine.encode(p) for p in prompts]
        results = engine.generate(ids, max_new_tokens=max_new_tokens, ignore_eos=True)
        return [r.token_ids for r in results], engine

    plain, engine = generate(MTPSection())
    report: dict[str, Any] = {
        "checkpoint": str(checkpoint), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "device": device, "dtype": dtype, "k": {},
    }  # fmt: skip
    if draft_vocab:
        report |= {"draft_vocab": draft_vocab, "draft_vocab_file": draft_vocab_file}
    if draft_lm_head != "bf16":
        report["draft_lm_head"] = draft_lm_head
    for k in ks:
        tokens, engine = generate(
            MTPSection(
                enabled=True,
                k=k,
                draft_vocab=draft_vocab,
                draft_vocab_file=draft_vocab_file,
                draft_lm_head=draft_lm_head,
            )
        )
        totals = engine.speculator.totals
        report["k"][str(k)] = {
            "acceptance_length": round(totals.acceptance_length, 4),
            "position_acceptance": [round(p, 4) for p in totals.position_acceptance],
            "verify_steps": totals.verify_steps,
            "matches_mtp_off": tokens == plain,
        }
        if log:
            log(f"K={k}: acceptance length {totals.acceptance_length:.3f}, matches MTP off: {tokens == plain}")
    report["sample"] = {"prompt": prompts[0], "output": engine.decode(plain[0])}
    return report
