"""`qwen-mtp run` as a user runs it: the installed console script on the shipped default recipe."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    exe = shutil.which("qwen-mtp")
    assert exe, "the qwen-mtp console script is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_run_default_recipe():
    proc = _run("run", "recipes/tiny.yaml", "--set", "run.max_new_tokens=6")
    assert proc.returncode == 0, proc.stderr
    assert "fixture tiny" in proc.stdout and "MTP head: yes" in proc.stdout
    assert "decode path: eager on cpu (no MTP)" in proc.stdout
    assert proc.stdout.count("output (6 tokens, length)") == 3
    assert "tokens/s" in proc.stdout
    assert "generating up to 18 tokens" in proc.stderr  # off a terminal: a line at the start, every 5 s, at the end
    assert "generated 18/18 tokens" in proc.stderr


def test_run_reports_progress_off_a_terminal():
    """A log (no TTY) gets plain progress lines while the run generates, counting up to every token."""
    proc = _run("run", "recipes/tiny.yaml", "--set", "run.max_new_tokens=5", "--progress-every", "0")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("generated ")]
    counts = [int(line.split()[1].split("/")[0]) for line in lines]
    assert len(lines) >= 5 and counts == sorted(counts) and lines[-1].startswith("generated 15/15 tokens")


def test_progress_on_a_terminal_is_a_bar():
    import io

    from qwen_mtp.cli import TokenProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = TokenProgress(12, every=5.0, stream=stream)
    progress.update(4)
    progress.total -= 2  # a request stopped at EOS
    progress.update(6)
    assert (progress.bar.n, progress.bar.total) == (10, 10)
    progress.close()
    assert "generating" in stream.getvalue() and "generated " not in stream.getvalue()  # a bar, no plain lines


def test_run_reports_bad_recipe_cleanly(tmp_path):
    proc = _run("run", "recipes/tiny.yaml", "--set", "mtp.k=9")
    assert proc.returncode == 2 and "mtp.k must be 1..4 or auto, got 9" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run("run", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "not found" in proc.stderr
    proc = _run("run", str(tmp_path))
    assert proc.returncode == 2 and "is a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_run_with_mtp_prints_acceptance():
    plain = _run("run", "recipes/tiny.yaml", "--set", "run.max_new_tokens=8")
    proc = _run(
        "run", "recipes/tiny.yaml", "--set", "mtp.enabled=true", "--set", "mtp.k=2", "--set", "run.max_new_tokens=8"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("MTP: ") == 3 and "MTP k=2, head drafts:" in proc.stdout
    assert "acceptance length" in proc.stdout and "per-position acceptance [" in proc.stdout
    token_lines = [line for line in proc.stdout.splitlines() if "token ids:" in line]
    assert token_lines == [line for line in plain.stdout.splitlines() if "token ids:" in line]  # lossless


def test_bench_reports_every_row_exact(tmp_path):
    """`qwen-mtp bench` on the tiny fixture (CPU): plain + MTP rows, token-exact, table/JSON written.
    (Speed is never asserted; this checks the report.)"""
    import json

    proc = _run(
        "bench", "recipes/bench-tiny.yaml", "--set", "bench.batch_sizes=[2]", "--set", "bench.ks=[2]",
        "--set", "bench.accept_rates=[1.0]", "--set", "bench.output_len=6", "--set", f"bench.out_dir={tmp_path}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    assert [(r["mode"], r["k"], r["draft"]) for r in rows] == [
        ("plain", 0, "-"),
        ("mtp", 2, "oracle"),
        ("mtp", 2, "head"),
    ]
    assert all(r["exact"] for r in rows)
    assert rows[1]["acceptance_length"] > 2.0  # oracle 1.0, output cut at 6 tokens
    assert "x plain" in proc.stdout and (tmp_path / "bench.txt").exists()


def _without(monkeypatch, module):
    """importlib as it is where `module` is not installed."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))


def test_serve_without_the_serve_extra_says_what_to_install(monkeypatch):
    """`qwen-mtp serve` where fastapi is missing: one line naming the install command, before any model loads."""
    from typer.testing import CliRunner

    from qwen_mtp.cli import app

    def started(*args):
        raise AssertionError("the ranks started without the serving packages")

    monkeypatch.setattr("qwen_mtp.parallel.launch.run_ranks", started)
    _without(monkeypatch, "fastapi")
    result = CliRunner().invoke(app, ["serve", str(ROOT / "recipes/tiny.yaml")])
    assert result.exit_code == 2 and not isinstance(result.exception, ImportError)
    assert "fastapi" in result.output and "pip install 'qwen-mtp[serve]'" in result.output


def test_eval_without_lm_eval_says_what_to_install(monkeypatch):
    import pytest

    from qwen_mtp.eval.__main__ import main

    _without(monkeypatch, "lm_eval")
    with pytest.raises(SystemExit, match=r"lm_eval, from the 'serve' extra: pip install 'qwen-mtp\[serve\]'"):
        main()
