"""Write the best plans of one or more `gemm_sweep.py --family` reports into the `TUNED` table of
qwen_mtp/ops/linear.py (the table's comment names the report), so the plans a sweep found are the plans the
engine runs, with no hand copying. Shapes a report has no invariant plan for keep their current entry.
`--fp8`: the same for `gemm_fp8.py --family` reports (W8A16 plans, `gemm_fp8.best_fp8_plan`) into `TUNED_FP8`.
Usage: python3 benchmarks/apply_plans.py REPORT.json [REPORT.json ...] [--slack 0.12] [--fp8] [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from gemm_family import SMALL_M_SLACK, best_plan

from qwen_mtp.ops.linear import TUNED, TUNED_FP8, GemmPlan

LINEAR = Path(__file__).resolve().parents[1] / "qwen_mtp" / "ops" / "linear.py"


def table_pattern(name: str) -> re.Pattern:
    """The table's whole text in linear.py: `{...}` over several lines, or an empty `{}`."""
    return re.compile(rf"^{name}: dict\[tuple\[int, int\], GemmPlan\] = \{{(?:\}}|\n.*?^\}})\n", re.S | re.M)


def best_plans(reports: list[Path], slack: float) -> dict[tuple[int, int], tuple[GemmPlan, str]]:
    """(N, K) -> (best plan by `gemm_family.best_plan` with this slack, a comment: the shape's names and the
    plan's label) over the reports, in report order."""
    plans: dict[tuple[int, int], tuple[GemmPlan, str]] = {}
    for path in reports:
        report = json.loads(path.read_text())
        for name, entry in report["shapes"].items():
            timed = entry["plans"].items()
            results = {label: r | {"us": {int(m): t for m, t in r["us"].items()}} for label, r in timed}
            cublas = {int(m): t for m, t in entry["cublas_us"].items()}
            label = best_plan(results, cublas, slack)
            if label is not None:
                plan = GemmPlan(**entry["plans"][label]["plan"])
                plans[entry["n"], entry["k"]] = plan, f"{report['preset']} {name}: {label}"
    return plans


def best_fp8_plans(reports: list[Path]) -> dict[tuple[int, int], tuple[GemmPlan, str]]:
    """(N, K) -> (best W8A16 plan by `gemm_fp8.best_fp8_plan`, a comment) over `gemm_fp8.py --family` reports."""
    from gemm_fp8 import best_fp8_plan

    plans: dict[tuple[int, int], tuple[GemmPlan, str]] = {}
    for path in reports:
        report = json.loads(path.read_text())
        if report.get("kind") != "fp8":
            raise SystemExit(f"{path} is not a `gemm_fp8.py --family` report (apply bf16 reports without --fp8)")
        for name, entry in report["shapes"].items():
            timed = entry["plans"].items()
            results = {label: r | {"us": {int(m): t for m, t in r["us"].items()}} for label, r in timed}
            label = best_fp8_plan(results)
            if label is not None:
                plan = GemmPlan(**entry["plans"][label]["plan"])
                plans[entry["n"], entry["k"]] = plan, f"{report['preset']} {name}: {label}"
    return plans


def plan_text(plan: GemmPlan) -> str:
    """The plan as a short constructor call: the five tile fields by position, then every other field that differs
    from its default (the grid family's 16-row tiles). Every table an `--apply` writes spells its plans so."""
    fields = dataclasses.fields(plan)
    head = [repr(getattr(plan, f.name)) for f in fields[:5]]
    extra = [f"{f.name}={getattr(plan, f.name)!r}" for f in fields[5:] if getattr(plan, f.name) != f.default]
    return f"GemmPlan({', '.join(head + extra)})".replace("'", '"')


def table_text(plans: dict[tuple[int, int], tuple[GemmPlan, str]], name: str = "TUNED") -> str:
    lines = [f"{name}: dict[tuple[int, int], GemmPlan] = {{"]
    for (n, k), (plan, comment) in plans.items():
        lines += [f"    # {comment}", f"    ({n}, {k}): {plan_text(plan)},"]
    return "\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--slack", type=float, default=SMALL_M_SLACK, help="see gemm_family.best_plan")
    parser.add_argument("--fp8", action="store_true", help="gemm_fp8.py --family reports into TUNED_FP8")
    parser.add_argument("--dry-run", action="store_true", help="print the table, leave linear.py as it is")
    args = parser.parse_args()
    name, current = ("TUNED_FP8", TUNED_FP8) if args.fp8 else ("TUNED", TUNED)
    found = best_fp8_plans(args.reports) if args.fp8 else best_plans(args.reports, args.slack)
    plans = {nk: (plan, "kept (no invariant plan in the reports)") for nk, plan in current.items()} | found
    text = table_text(plans, name)
    if args.dry_run:
        print(text)
        return
    source, table = LINEAR.read_text(), table_pattern(name)
    if not table.search(source):
        raise SystemExit(f"no {name} table found in {LINEAR}")
    LINEAR.write_text(table.sub(lambda _: text, source, count=1))
    print(f"wrote {len(found)} plans from {len(args.reports)} report(s) into {name} in {LINEAR}")


if __name__ == "__main__":
    main()
