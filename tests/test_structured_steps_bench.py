"""`benchmarks/structured_steps.py` (what a constrained step costs, run on the H200) on this machine: on the shipped
model a constrained batch gives MTP-off's tokens under MTP, its masks are timed where the runner makes them, and a
synthetic model's vocabulary gets a tokenizer widened to it."""

import json
import sys
from pathlib import Path

from helpers import benchmark_module

ROOT = Path(__file__).resolve().parents[1]


def test_the_structured_steps_bench_runs_exact_on_the_shipped_model(tmp_path, monkeypatch):
    bench = benchmark_module("structured_steps")
    out = tmp_path / "report.json"
    argv = [str(ROOT / "recipes" / "small.yaml"), "--set", f"model.path={ROOT / 'models' / 'qwen-mtp-small'}",
            "--set", "model.device=cpu", "--batch", "2", "--tokens", "6", "--grammars", "free", "regex line",
            "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["structured_steps.py", *argv])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["grammar"], r["exact"]) for r in rows] == [(2, "free", True), (2, "regex line", True)]
    free, constrained = (r["mtp"] for r in rows)
    assert free["mask_calls"] == 0 and constrained["mask_calls"] > 0 and constrained["masks_ms_per_step"] > 0


def test_a_tokenizer_is_widened_to_the_model_vocabulary():
    """Random printable tokens appended up to the vocabulary (its special tokens already inside it), the checkpoint's
    own tokens unchanged; a vocabulary the tokenizer already fills leaves it as it is."""
    bench = benchmark_module("structured_steps")
    shipped = ROOT / "models" / "qwen-mtp-small"
    own = bench.tokenizer_for(shipped, 1)
    assert len(bench.tokenizer_for(shipped, len(own))) == len(own)
    wide = bench.tokenizer_for(shipped, len(own) + 100)
    assert len(own) + 90 < len(wide) <= len(own) + 100
    assert wide.encode("def main():") == own.encode("def main():")
