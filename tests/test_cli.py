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
    assert proc.stdout.count("output (6 tokens, length)") == 3
    assert "tokens/s" in proc.stdout


def test_run_reports_bad_recipe_cleanly(tmp_path):
    proc = _run("run", "recipes/tiny.yaml", "--set", "mtp.k=9")
    assert proc.returncode == 2 and "mtp.k must be 1..4, got 9" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run("run", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "not found" in proc.stderr


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
