"""The FP8 plan flow without a GPU: a `benchmarks/gemm_fp8.py --family` report -> `benchmarks/apply_plans.py --fp8`
-> the `TUNED_FP8` table, choosing per shape the invariant plan with the lowest mean time at decode row counts."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import benchmark_module

ROOT = Path(__file__).resolve().parents[1]


def _plan(block_n, **extra):
    return dict(block_n=block_n, block_k=128, k_per_split=40, num_warps=4, num_stages=4, family="stream",
                block_m=16, row_tiles=2, swap_ab=True) | extra  # fmt: skip


def _entry(us, fails=()):
    return dict(plan=None, us={str(m): t for m, t in zip((1, 8, 16, 32, 64, 128), us, strict=True)},
                invariance_failures=list(fails))  # fmt: skip


def _report():
    fast_big_m = _entry([50, 50, 50, 50, 50, 10])  # M = 128 is not a decode size the choice weighs
    fast_big_m["plan"] = _plan(64, num_stages=8)
    steady = _entry([46, 46, 47, 47, 48, 90])
    steady["plan"] = _plan(128, num_warps=8)
    broken = _entry([1, 1, 1, 1, 1, 1], fails=["M=17"])  # fastest, but its rows depend on M
    broken["plan"] = _plan(32)
    only = _entry([20, 20, 20, 21, 22, 30])
    only["plan"] = _plan(64, k_per_split=16)
    return dict(preset="qwen3.5-27b", kind="fp8", shapes={
        "mlp gate_up": dict(n=34816, k=5120, plans={"a": fast_big_m, "b": steady, "c": broken}),
        "mlp down": dict(n=5120, k=17408, plans={"only": only}),
    })  # fmt: skip


def _apply(tmp_path, report, *flags):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "apply_plans.py"), str(path), "--dry-run", *flags]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_apply_plans_fp8_writes_the_best_invariant_plan_per_shape(tmp_path):
    done = _apply(tmp_path, _report(), "--fp8")
    assert done.returncode == 0, done.stderr
    table = done.stdout
    assert table.startswith("TUNED_FP8: dict[tuple[int, int], GemmPlan] = {")
    assert "# qwen3.5-27b mlp gate_up: b\n    (34816, 5120): GemmPlan(128, 128, 40, 8, 4, " in table
    assert '(5120, 17408): GemmPlan(64, 128, 16, 4, 4, family="stream", row_tiles=2, swap_ab=True),' in table


def test_apply_plans_fp8_refuses_a_bf16_report(tmp_path):
    report = _report()
    del report["kind"]
    done = _apply(tmp_path, report, "--fp8")
    assert done.returncode != 0 and "not a `gemm_fp8.py --family` report" in done.stderr


def test_apply_plans_finds_both_tables_in_linear_py_empty_or_not():
    """apply_plans rewrites TUNED and TUNED_FP8 in place: its pattern must find each as linear.py holds it (an
    empty `{}` on one line included: TUNED_FP8 before its first plans)."""
    apply_plans = benchmark_module("apply_plans")
    source = apply_plans.LINEAR.read_text()
    for name in ("TUNED", "TUNED_FP8"):
        assert apply_plans.table_pattern(name).search(source), name
    empty = "TUNED_FP8: dict[tuple[int, int], GemmPlan] = {}\nafter = 1\n"
    assert apply_plans.table_pattern("TUNED_FP8").sub("X\n", empty) == "X\nafter = 1\n"


def test_plan_text_spells_every_field_that_is_not_its_default():
    """Every `--apply` writes plans with `apply_plans.plan_text`: read back, each is the plan it wrote, whichever
    of GemmPlan's fields it sets (a field the writer did not know of would be lost)."""
    from qwen_mtp.ops.linear import GemmPlan

    plan_text = benchmark_module("apply_plans").plan_text
    tma = GemmPlan(256, 64, 80, 8, 3, family="tma", block_m=128, group_m=16, persistent=True)
    assert plan_text(tma) == 'GemmPlan(256, 64, 80, 8, 3, family="tma", block_m=128, group_m=16, persistent=True)'
    plans = [
        tma,
        GemmPlan(128, 64, 16),
        GemmPlan(64, 64, 80, 4, 6, "stream", 64, 1, True, 0, 16, 8),
        GemmPlan(64, 128, 40, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True, tma_loads=True),
        GemmPlan(128, 64, 32, 8, 6, family="stream", block_m=64, l2_prefetch=4),
    ]
    for plan in plans:
        assert eval(plan_text(plan), {"GemmPlan": GemmPlan}) == plan, plan_text(plan)
