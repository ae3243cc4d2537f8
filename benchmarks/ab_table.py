"""The A/B of `benchmarks/gpu_suite.sh` STAGE=prefetch as one table: every bench run under a folder (its
`bench-MODEL-SETTING[-runN]/bench.json`), step ms per (model, context, B, mode, K) and setting, each setting's runs in
the order they ran, then each setting's mean against the first setting's, and whether every row of every run was
exact. The settings come in `--settings` order (the stage's SETTINGS; "tree:DIR" as its folder names it), else
"baseline" first and the rest sorted. A cold first run (the Triton cache filling) can be left out with
`--skip-first`.

Usage: python3 benchmarks/ab_table.py OUT_DIR [--settings SETTING ...] [--skip-first SETTING ...]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

RUN = re.compile(r"^bench-(?P<model>[a-z0-9]+)-(?P<setting>.+?)(?:-run(?P<run>\d+))?$")


def collect(
    out_dir: Path, skip_first: tuple[str, ...] = (), order: tuple[str, ...] = ()
) -> tuple[dict, list[str], bool]:
    """{(model, ctx, B, mode, K): {setting: [step ms of each run]}}, the settings in order, all exact."""
    runs = []
    for report in out_dir.glob("bench-*/bench.json"):
        match = RUN.match(report.parent.name)
        if match:
            runs.append((match["model"], match["setting"], int(match["run"] or 1), json.loads(report.read_text())))
    runs.sort(key=lambda run: (run[0], run[2]))
    table, exact = defaultdict(lambda: defaultdict(list)), True
    for model, setting, run, report in runs:
        if run == 1 and setting in skip_first:
            continue
        for row in report["rows"]:
            key = (model, row["prompt_len"], row["batch"], row["mode"], row["k"])
            table[key][setting].append(row["step_ms"])
            exact = exact and bool(row["exact"])
    found = {setting for runs_of in table.values() for setting in runs_of}
    named = [s for s in dict.fromkeys(re.sub(r"[^A-Za-z0-9_-]", "", s) for s in order) if s in found]
    rest = sorted(found - set(named), key=lambda s: (s != "baseline", s))
    return table, named + rest, exact


def render(table: dict, settings: list[str], exact: bool) -> str:
    """The table: step ms of each run, then each setting's mean / the first setting's mean."""
    head = ["model", "ctx", "B", "mode"] + settings + [f"{s} / {settings[0]}" for s in settings[1:]]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for (model, ctx, batch, mode, k), runs in sorted(table.items()):
        cells = [model, str(ctx), str(batch), mode + (f" K={k}" if k else "")]
        cells += [" / ".join(f"{ms:.2f}" for ms in runs.get(s, [])) or "-" for s in settings]
        base = runs.get(settings[0])
        for s in settings[1:]:
            mine = runs.get(s)
            ratio = (sum(mine) / len(mine)) / (sum(base) / len(base)) if mine and base else None
            cells.append(f"{ratio:.4f}" if ratio else "-")
        lines.append(" | ".join(cells))
    lines.append(f"every row of every run exact: {exact}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--settings", nargs="*", default=[], help="the settings' order (the stage's SETTINGS)")
    parser.add_argument("--skip-first", nargs="*", default=[], help="settings whose first run warmed the cache")
    args = parser.parse_args()
    print(render(*collect(args.out_dir, tuple(args.skip_first), tuple(args.settings))))


if __name__ == "__main__":
    main()
