"""Test helpers. Hugging Face transformers is the reference implementation (its torch path: fla is not
installed on CPU)."""

from __future__ import annotations

import importlib
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from qwen_mtp.engine.k_policy import KPolicy

# bf16 greedy tokens are compared with HF's only up to HF's first step whose top-2 logits are closer than this.
# At such a near-tie HF's own incremental decode and its own full forward can pick different tokens, and which
# one depends on the CPU (oneDNN picks kernels by ISA) and the transformers version: seen on an AVX-512 machine
# with transformers 5.24, logits 3.0000 vs 2.9844 (1 ulp) picked 191 where the full forward and we pick 10.
NEAR_TIE_ULPS = 2.0


def load_hf(path, dtype: torch.dtype):
    # from_pretrained(dtype=...), never .to(dtype): the latter also rounds the rotary inverse frequencies.
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids: list[int] | None) -> list[int]:
    return hf_greedy_with_margins(model, prompt, max_new_tokens, eos_ids)[0]


@torch.inference_mode()
def hf_greedy_with_margins(
    model, prompt: list[int], max_new_tokens: int, eos_ids: list[int] | None
) -> tuple[list[int], list[float]]:
    """HF `generate`'s greedy tokens and, for each, HF's own margin: its top-1 minus its top-2 logit at that
    step, in ulps of the model's dtype at the larger logit's magnitude (0 for an exact tie)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=(eos_ids or [0])[0],
        output_logits=True,
        return_dict_in_generate=True,
    )
    finfo = torch.finfo(model.dtype)
    margins = []
    for logits in out.logits:  # one [1, vocab] per generated token, the logits HF chose it from
        top = logits[0].float().topk(2).values
        ulp = finfo.eps * 2.0 ** torch.floor(torch.log2(top.abs().max().clamp(min=finfo.tiny)))
        margins.append(float((top[0] - top[1]) / ulp))
    return out.sequences[0, len(prompt) :].tolist(), margins


def assert_greedy_matches_hf(
    ours: list[int], model, prompt: list[int], max_new_tokens: int, eos_ids: list[int] | None = None
) -> int:
    """Assert our greedy tokens equal HF `generate`'s; returns how many were compared.

    fp32: every token, bit-exact. bf16 / fp16: the tokens before HF's first near-tie (top-2 margin under
    `NEAR_TIE_ULPS`), all of them when it has none; past a near-tie HF may continue another text on another
    machine. Callers assert a minimum over their prompts, so the comparison cannot silently shrink to nothing."""
    if model.dtype == torch.float32:
        expected = hf_greedy(model, prompt, max_new_tokens, eos_ids)
        return assert_matches_reference(ours, expected, None, f"prompt of {len(prompt)} tokens")
    expected, margins = hf_greedy_with_margins(model, prompt, max_new_tokens, eos_ids)
    return assert_matches_reference(ours, expected, margins, f"prompt of {len(prompt)} tokens")


def assert_matches_reference(ours: list[int], expected: list[int], margins: list[float] | None, what: str) -> int:
    """`assert_greedy_matches_hf` on HF's tokens already computed: `margins` None compares every token (fp32);
    otherwise only those before HF's first near-tie. Returns how many were compared."""
    if margins is None:
        assert ours == expected, f"{what}: ours {ours} != HF {expected}"
        return len(expected)
    trusted = next((i for i, margin in enumerate(margins) if margin < NEAR_TIE_ULPS), len(expected))
    got = ours if trusted == len(expected) else ours[:trusted]
    assert got == expected[:trusted], (
        f"{what}: ours {ours} != HF {expected} within the {trusted} tokens before HF's "
        f"first near-tie (margins in ulps: {[round(m, 1) for m in margins]})"
    )
    return trusted


def random_prompt(length: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class RandomK(KPolicy):
    """A `mtp.k: auto` policy for tests: K = 0..`max_k` at random (seeded), kept with probability 0.7 so steps
    chain under `cache.lookahead`. The rest (acceptance figures, `stepped`, `observe`) is `KPolicy`'s own."""

    def __init__(self, seed: int, max_k: int = 3):
        super().__init__(max_k, [1], no_step_times)
        self.rng, self.k = random.Random(seed), 2

    def measured(self, count):
        return True

    def choose(self, count):
        if self.rng.random() > 0.7:
            self.k = self.rng.randint(0, self.max_k)
        return self.k


def no_step_times(bucket: int):
    raise AssertionError("a test policy that chooses K itself needs no step times")


def chained_launches(engine) -> list[tuple[int, int]]:
    """Record `engine`'s chained verify launches (`cache.lookahead`) from now on: the list it returns gains (the K
    of the verify in flight, which the chained one keeps; how many requests it verifies) at each."""
    chained, launch = [], engine._launch_verify

    def recorded(requests, after=None):
        if after is not None:
            chained.append((after.verified.k, len(requests)))
        return launch(requests, after)

    engine._launch_verify = recorded
    return chained


def random_traffic(engine, rng, arrivals: int, arrive: float, cancel: float, submit, each_step=None):
    """Seeded traffic on `engine`: for the first `arrivals` steps a request arrives with probability `arrive`
    (`submit(rng)` submits it and returns its id and what the test keeps of it), and a live request is cancelled
    with probability `cancel`; then steps until everything ends (`each_step()` after every step). Returns {id:
    kept} and the set of cancelled ids."""
    submitted, cancelled, steps = {}, set(), 0
    while steps < arrivals or engine.has_unfinished():
        if steps < arrivals and rng.random() < arrive:
            rid, kept = submit(rng)
            submitted[rid] = kept
        live = [rid for rid in submitted if not engine.requests[rid].done]
        if live and rng.random() < cancel:
            victim = rng.choice(live)
            engine.cancel(victim)
            cancelled.add(victim)
        engine.step()
        steps += 1
        if each_step is not None:
            each_step()
    return submitted, cancelled


def cpu_engine(path, k: int | None = None, quant: str = "none", **mtp):
    """An fp32 CPU engine on the checkpoint at `path` (`quant`: `model.quant`), prefill chunks of 16 tokens: MTP
    off, or on with K = `k` and the other `mtp.*` settings given."""
    from qwen_mtp import Engine

    model = {"path": str(path), "dtype": "float32", "device": "cpu", "quant": quant}
    recipe = {"model": model, "cache": {"prefill_chunk": 16}}
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, **mtp}
    return Engine.from_recipe(recipe, log=lambda _: None)


def run_batch(engine, params, prompts: list[list[int]], oracles: list[list[int]] | None = None) -> list:
    """Every prompt with params(i) as one continuous batch (with oracle drafts when `oracles` are given): each
    request's `Result`, after checking that every page and state row went back to the pools."""
    if oracles is None:
        ids = [engine.submit(p, params(i)) for i, p in enumerate(prompts)]
    else:
        pairs = enumerate(zip(prompts, oracles, strict=True))
        ids = [engine.submit_with_oracle(p, o, params(i)) for i, (p, o) in pairs]
    while engine.has_unfinished():
        engine.step()
    results = [engine.result(i) for i in ids]
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["free_state_rows"] == stats["total_state_rows"]
    return results


def reference_lltokenizer(path) -> tuple:
    """(the checkpoint's tokenizer, llguidance's tokenizer over it and the config's vocabulary, EOS the tokenizer's),
    built as llguidance's docs say and not by the engine, so that the structured-output tests check the engine
    against llguidance itself."""
    import json

    import llguidance.hf

    from qwen_mtp.engine.setup import load_tokenizer

    tokenizer = load_tokenizer(Path(path))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[tokenizer.eos_token_id])


def generate_all(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Every prompt with params(i), as one continuous batch: each one's generated tokens."""
    ids = [engine.submit(p, params(i)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [engine.result(i).token_ids for i in ids]


def benchmark_module(name: str):
    """`benchmarks/<name>.py` imported as its scripts run (their sibling modules found beside them), for tests of
    the pure parts of a benchmark; sys.path is left as it was."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def running(pid: int) -> bool:
    """Process `pid` exists and has not exited (a zombie waiting for its parent has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float = 30.0) -> None:
    """Wait until none of `pids` runs (e.g. a launcher's ranks after it stopped); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes still running: {[p for p in pids if running(p)]}"
        time.sleep(0.1)
