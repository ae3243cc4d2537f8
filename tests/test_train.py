"""`qwen-mtp train` on CPU: a tiny model on a small local corpus learns, its MTP head trains, the checkpoint is
one transformers loads (same greedy tokens), resume continues exactly, compile equals eager, bad settings are
RecipeErrors."""

from __future__ import annotations

import hashlib
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches_hf, load_hf
from typer.testing import CliRunner

from qwen_mtp import Engine
from qwen_mtp.cli import app
from qwen_mtp.errors import RecipeError
from qwen_mtp.recipe import TrainSection, load_recipe
from qwen_mtp.train import train
from qwen_mtp.train.checkpoint import load_resume
from qwen_mtp.train.corpus import HELDOUT_EVERY, Corpus, is_heldout
from qwen_mtp.train.loss import joint_loss
from qwen_mtp.train.model import fresh_model, model_config

# A tiny shape: 4 layers (3 GDN + 1 attention) of width 64, a 384-token vocabulary, windows of 48 tokens.
TINY = {
    "vocab_size": 384, "hidden_size": 64, "num_layers": 4, "intermediate_size": 128, "attention_heads": 4,
    "kv_heads": 2, "head_dim": 32, "gdn_key_heads": 2, "gdn_value_heads": 4, "gdn_head_dim": 16,
    "seq_len": 48, "batch_size": 4, "warmup_steps": 5, "lr": 0.003, "precision": "fp32", "device": "cpu",
    "log_every": 5, "eval_tokens": 2048, "save_dtype": "float32",
}  # fmt: skip


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A few standard-library packages copied into a folder (their names decide their split)."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email", "html"):
        shutil.copytree(stdlib / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _recipe(corpus_dir: Path, out: Path, **train_keys) -> object:
    return load_recipe({"train": {**TINY, "corpus": str(corpus_dir), "output_dir": str(out), **train_keys}})


@pytest.fixture(scope="session")
def trained(corpus_dir, tmp_path_factory):
    """30 joint steps through the CLI, as a user runs it."""
    out = tmp_path_factory.mktemp("trained")
    keys = {**TINY, "corpus": str(corpus_dir), "output_dir": str(out), "steps": 30}
    args = [f"--set=train.{k}={v}" for k, v in keys.items()]
    result = CliRunner().invoke(app, ["train", str(_empty_recipe(out)), *args])
    assert result.exit_code == 0, result.output
    return out


def _empty_recipe(out: Path) -> Path:
    path = out.parent / f"{out.name}.yaml"
    path.write_text("train: {}\n")
    return path


def test_thirty_steps_lower_both_losses(trained):
    summary = (trained / "train-summary.json").read_text()
    import json

    history = [h for h in json.loads(summary)["history"] if "lm" in h]
    assert [h["step"] for h in history] == [5, 10, 15, 20, 25, 30]
    assert history[-1]["lm"] < history[0]["lm"] - 0.5
    assert history[-1]["mtp"] < history[0]["mtp"] - 0.5
    assert (trained / "loss.png").stat().st_size > 1000
    assert json.loads(summary)["heldout"]["perplexity"] > 1.0


def test_every_mtp_head_parameter_gets_a_gradient():
    config = model_config(TrainSection(**TINY), eos_id=0)
    model = fresh_model(config, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    windows = torch.randint(0, TINY["vocab_size"], (2, 18), generator=torch.Generator().manual_seed(0))
    loss, _ = joint_loss(model, windows, mtp_weight=0.5)
    loss.backward()
    head = dict(model.mtp.named_parameters())
    assert head and all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.values()), [
        name for name, p in head.items() if p.grad is None or p.grad.abs().sum() == 0
    ]


def test_checkpoint_loads_in_transformers_with_the_same_greedy_tokens(trained):
    path = trained / "model"
    engine = Engine.from_recipe({"model": {"path": str(path), "dtype": "float32", "device": "cpu"}})
    prompts = [engine.encode("def loads(s, *, cls=None):\n    "), engine.encode("class HTMLParser:\n")]
    results = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    hf = load_hf(path, torch.float32)
    assert any(name.startswith("mtp.") for name in _tensor_names(path))
    compared = sum(assert_greedy_matches_hf(r.token_ids, hf, p, 12) for p, r in zip(prompts, results, strict=True))
    assert compared == 24
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert tokenizer.decode(tokenizer.encode("    return x  # ok\n")) == "    return x  # ok\n"


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


def test_mtp_only_trains_the_head_and_nothing_else(trained, corpus_dir, tmp_path):
    from safetensors.torch import load_file

    train(_recipe(corpus_dir, tmp_path, steps=4, mode="mtp-head", init=str(trained / "model")), log=lambda _: None)
    before = load_file(trained / "model" / "model.safetensors")
    after = load_file(tmp_path / "model" / "model.safetensors")
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {name for name in before if name.startswith("mtp.")}


class _Cut(Exception):
    pass


def test_resume_continues_from_the_saved_step(corpus_dir, tmp_path):
    """A run cut after its step-5 resume point, started again, ends with the weights of an uncut run."""
    whole = train(_recipe(corpus_dir, tmp_path / "whole", steps=10, save_every=5), log=lambda _: None)

    def cut_at_step_10(line: str) -> None:
        if line.startswith("step 10/"):  # logged before step 10's resume point is written
            raise _Cut

    cut = _recipe(corpus_dir, tmp_path / "cut", steps=10, save_every=5)
    with pytest.raises(_Cut):
        train(cut, log=cut_at_step_10)
    assert load_resume(tmp_path / "cut" / "resume.pt")["step"] == 5
    lines = []
    resumed = train(cut, log=lines.append)
    assert any(line.startswith("resumed from") and "at step 5 of 10" in line for line in lines)
    assert [h["step"] for h in resumed.summary["history"] if "lm" in h] == [5, 10]
    from safetensors.torch import load_file

    a, b = load_file(whole.checkpoint / "model.safetensors"), load_file(resumed.checkpoint / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_compiled_training_step_matches_eager():
    """torch.compile (inductor) of the joint loss: the same loss and gradients as eager up to fp32 rounding.
    Not bitwise: inductor fuses the elementwise ops and reductions (softmax, cross-entropy, RMSNorm sums)
    into its own kernels, which add in another order."""
    torch.manual_seed(0)
    config = model_config(TrainSection(**{**TINY, "num_layers": 2, "full_attention_interval": 2}), eos_id=0)
    eager = fresh_model(config, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    compiled = fresh_model(config, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    windows = torch.randint(0, TINY["vocab_size"], (2, 34), generator=torch.Generator().manual_seed(1))
    from qwen_mtp.engine.graphs import register_inductor_fallbacks

    register_inductor_fallbacks()
    loss_eager, _ = joint_loss(eager, windows, 0.5)
    loss_compiled, _ = torch.compile(joint_loss)(compiled, windows, 0.5)
    loss_eager.backward()
    loss_compiled.backward()
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_split_is_the_documented_hash_rule():
    names = [f"pkg{i}/mod{j}.py" for i in range(40) for j in range(50)]
    expected = [n for n in names if int(hashlib.sha256(n.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0]
    assert [n for n in names if is_heldout(n)] == expected
    assert 0.03 < len(expected) / len(names) < 0.07


def test_corpus_files_follow_the_split(corpus_dir):
    corpus = Corpus(str(corpus_dir), ("**/*.py",))
    train_files, heldout = corpus.files("train"), corpus.files("heldout")
    assert {f.path for f in train_files}.isdisjoint(f.path for f in heldout)
    assert all(is_heldout(f.path) for f in heldout) and not any(is_heldout(f.path) for f in train_files)
    skipped = set(corpus.paths()) - {f.path for f in train_files + heldout}
    assert all(not (corpus_dir / path).read_text().strip() for path in skipped)  # only empty files are skipped
    assert not Corpus(str(corpus_dir), ("**/*.py",), ("email/*",)).paths()[0].startswith("email/")


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("mode", "head", "train.mode must be one of joint, target or mtp-head"),
        ("steps", 0, "train.steps must be >= 1"),
        ("lr", -0.1, "train.lr must be > 0"),
        ("lr", "fast", "train.lr must be a number"),
        ("kv_heads", 3, "train.attention_heads (4) must be a multiple of train.kv_heads (3)"),
        ("gdn_value_heads", 3, "train.gdn_value_heads (3) must be a multiple of train.gdn_key_heads"),
        ("vocab_size", 100, "train.vocab_size must be >= 300"),
        ("min_lr_ratio", 2.0, "train.min_lr_ratio must be in 0..1"),
        ("mtp_chain", 5, "train.mtp_chain must be 1..4"),
        ("device", "tpu", "train.device must be auto, cpu, cuda or cuda:N"),
        ("precision", "fp16", "train.precision must be bf16 or fp32"),
        ("include", [], "train.include must list at least one glob"),
        ("time_budget_s", 0, "train.time_budget_s must be > 0 or null"),
        ("warmup", 10, "unknown key train.warmup"),
    ],
)
def test_bad_train_settings_are_recipe_errors(key, value, message):
    with pytest.raises(RecipeError, match=rf"^{message.replace('(', '[(]').replace(')', '[)]')}"):
        load_recipe({"train": {key: value}})


def test_a_corpus_without_files_is_a_recipe_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="no train files"):
        train(_recipe(tmp_path / "empty", tmp_path / "out", steps=1), log=lambda _: None)
