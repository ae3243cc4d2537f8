"""Draft vocabularies (`mtp.draft_vocab`): the MTP head scores only N ids, the target still verifies against the
whole vocabulary, so MTP-on == MTP-off greedy and sampled at batch 8; sampled drafts meet the noise of their full
ids (coupled); the count file and `qwen-mtp draft-vocab`; and the shipped model's acceptance with a draft
vocabulary as docs/mtp.md reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import cpu_engine, generate_all, random_prompt

from qwen_mtp import Engine, RecipeError, SamplingParams
from qwen_mtp.engine.draft_vocab import draft_ids, read_counts, write_counts
from qwen_mtp.engine.sampling import Mode
from qwen_mtp.model.mtp import DraftLmHead
from qwen_mtp.ops.sampling import gumbel_noise

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "qwen-mtp-small"
FIGURES = SMALL / "acceptance_draft_vocab.json"  # written by `qwen-mtp acceptance ... --draft-vocab N`
MAX_NEW = 12
PROMPTS = [random_prompt(n, seed=600 + n) for n in (1, 4, 5, 33, 2, 19, 9, 17)]


def greedy(i):
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


def sampled(i):
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7 * i + 1)


def counts_file(tmp_path, vocab: int) -> str:
    """A count file over a random half of the vocabulary (a skewed draw, so the order is not the id order)."""
    gen = torch.Generator().manual_seed(5)
    draws = torch.multinomial(torch.rand(vocab, generator=gen) ** 4, 4 * vocab, replacement=True, generator=gen)
    path = tmp_path / "counts.tsv"
    write_counts(path, Counter(draws.tolist()), {"source": "test"})
    return str(path)


@pytest.mark.parametrize("params", [greedy, sampled], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_with_draft_vocab_equals_plain_batch8(checkpoint, tmp_path, k, params):
    path = checkpoint("tiny")
    vocab = Engine.from_recipe({"model": {"path": str(path), "device": "cpu"}}, log=lambda _: None).config.vocab_size
    expected = generate_all(cpu_engine(path), PROMPTS, params)
    for source, size in ((counts_file(tmp_path, vocab), vocab // 4), ("first", vocab // 2)):
        engine = cpu_engine(path, k, draft_vocab=size, draft_vocab_file=source)
        assert engine.runner.steps.draft_head.size == size
        assert generate_all(engine, PROMPTS, params) == expected
        stats = engine.stats()
        assert stats["verify_steps"] > 0 and stats["free_pages"] == stats["total_pages"]


def test_oracle_drafts_with_draft_vocab_equal_plain(checkpoint):
    """Oracle drafts (which may name ids outside the draft vocabulary) and acceptance 0.8: many accepted drafts."""
    path = checkpoint("tiny")
    expected = generate_all(cpu_engine(path), PROMPTS, greedy)
    engine = cpu_engine(path, 3, draft="oracle", oracle_accept=0.8, draft_vocab=16, draft_vocab_file="first")
    results = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == expected
    assert engine.stats()["acceptance_length"] > 2.0


def _drafts_of(engine, hidden, mode, positions, rows):
    with torch.inference_mode():
        return engine.runner.steps._propose(hidden, mode, positions, rows)


def test_draft_vocab_drafts_are_its_argmax_and_use_the_full_ids_noise(checkpoint):
    """Greedy: the argmax over the draft ids. Sampled: argmax over the draft ids of logit / T + g(seed, p, full
    id), the noise the target's choice uses for that id; with every id kept, exactly the drafts without one."""
    engine = cpu_engine(checkpoint("tiny"), 2)
    weight, vocab = engine.model.lm_head_weight, engine.model.lm_head_weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, weight.shape[1], generator=gen)
    positions = torch.arange(6) + 40
    rows = {"inv_temperature": torch.full((6,), 1.25), "top_k": torch.zeros(6, dtype=torch.long),
            "top_p": torch.ones(6), "min_p_offset": torch.full((6,), float("-inf")),
            "seed": torch.arange(6) * 1000 + 3}  # fmt: skip
    noise = Mode(noise=True)
    full = [_drafts_of(engine, hidden, mode, positions, rows if mode == noise else {}) for mode in (Mode(), noise)]
    ids = torch.randperm(vocab, generator=gen)[: vocab // 3]
    engine.runner.steps.draft_head = DraftLmHead(weight, ids)
    kept = ids.sort().values
    logits = hidden @ weight[kept].T
    assert torch.equal(_drafts_of(engine, hidden, Mode(), positions, {}), kept[logits.argmax(dim=-1)])
    scores = logits * 1.25 + gumbel_noise(rows["seed"], positions, vocab)[:, kept]
    assert torch.equal(_drafts_of(engine, hidden, noise, positions, rows), kept[scores.argmax(dim=-1)])
    engine.runner.steps.draft_head = DraftLmHead(weight, torch.arange(vocab))
    assert torch.equal(_drafts_of(engine, hidden, Mode(), positions, {}), full[0])
    assert torch.equal(_drafts_of(engine, hidden, noise, positions, rows), full[1])


def test_count_file_picks_the_most_frequent_ids(tmp_path):
    path = tmp_path / "counts.tsv"
    write_counts(path, Counter({7: 5, 3: 9, 12: 5, 1: 1}), {"model": "m"})
    assert read_counts(path) == [(3, 9), (7, 5), (12, 5), (1, 1)]  # most first, ties by id
    assert draft_ids(str(path), 3, 16).tolist() == [3, 7, 12]
    assert draft_ids(str(path), 6, 16).tolist() == [0, 1, 2, 3, 7, 12]  # then unlisted ids, ascending
    assert draft_ids("first", 4, 16).tolist() == [0, 1, 2, 3]
    with pytest.raises(RecipeError, match="outside the model's vocabulary"):
        draft_ids(str(path), 3, 10)
    with pytest.raises(RecipeError, match="must be 1..16"):
        draft_ids(str(path), 17, 16)
    (tmp_path / "bad.tsv").write_text("3\t9\n")
    with pytest.raises(RecipeError, match="not a count file"):
        draft_ids(str(tmp_path / "bad.tsv"), 3, 16)


def test_draft_vocab_recipe_needs_a_file(checkpoint):
    with pytest.raises(RecipeError, match="mtp.draft_vocab needs mtp.draft_vocab_file"):
        cpu_engine(checkpoint("tiny"), 2, draft_vocab=8)


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    exe = str(Path(sys.executable).with_name("qwen-mtp"))
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)


def test_draft_vocab_cli_counts_a_corpus_and_generations(checkpoint, tmp_path):
    path = checkpoint("tiny")
    engine = Engine.from_recipe({"model": {"path": str(path), "device": "cpu"}}, log=lambda _: None)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["def f(x):\n    return x + 1\n", "print('hello world')\n" * 3]
    for i, text in enumerate(texts):
        (corpus / f"{i}.py").write_text(text)
    out = tmp_path / "corpus.tsv"
    done = _cli("draft-vocab", str(path), "--corpus", str(corpus), "--out", str(out))
    assert done.returncode == 0, done.stderr
    expected = Counter(t for text in texts for t in engine.encode(text))
    assert dict(read_counts(out)) == dict(expected)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["def f(x):\n", "print("]}))
    out = tmp_path / "generated.tsv"
    done = _cli("draft-vocab", str(path), "--prompts", str(prompts), "--max-new-tokens", "5", "--dtype", "float32",
                "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = engine.generate([engine.encode(p) for p in ("def f(x):\n", "print(")], SamplingParams(max_new_tokens=5))
    assert dict(read_counts(out)) == dict(Counter(t for r in results for t in r.token_ids))


def test_shipped_model_draft_vocab_acceptance_matches_the_documented_figures():
    """The acceptance lengths docs/mtp.md reports for models/qwen-mtp-small with a draft vocabulary (from
    acceptance_draft_vocab.json), reproduced within 5%, with MTP-on == MTP-off (K=3, the recipe's)."""
    from qwen_mtp.train.evaluate import measure_acceptance, read_prompts

    documented = json.loads(FIGURES.read_text())
    doc = (ROOT / "docs" / "mtp.md").read_text()
    prompts = read_prompts()[: documented["prompts"]]
    for size, figures in documented["draft_vocab"].items():
        expected = figures["3"]["acceptance_length"]
        assert f"{expected:.2f}" in doc, f"N={size}: docs/mtp.md does not quote {expected:.2f}"
        if int(size) not in documented["tested"]:
            continue
        whole = int(size) == documented["vocab_size"]  # the full vocabulary's row: no draft vocabulary
        measured = measure_acceptance(
            SMALL, prompts, (3,), documented["max_new_tokens"], draft_vocab=0 if whole else int(size),
            draft_vocab_file=None if whole else str(SMALL / "draft_vocab.tsv"),
        )["k"]["3"]  # fmt: skip
        assert measured["matches_mtp_off"]
        got = measured["acceptance_length"]
        assert abs(got - expected) <= 0.05 * expected, f"N={size}: acceptance length {got:.3f}, documented {expected}"
