"""`benchmarks/ab_table.py` on bench reports laid out as STAGE=prefetch writes them."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from ab_table import collect, render  # noqa: E402


def _report(folder: Path, rows):
    folder.mkdir(parents=True)
    keys = ("prompt_len", "batch", "mode", "k", "step_ms", "exact")
    (folder / "bench.json").write_text(json.dumps({"rows": [dict(zip(keys, row, strict=True)) for row in rows]}))


def test_runs_line_up_per_setting_and_compare_with_the_first(tmp_path):
    _report(tmp_path / "bench-fp8-baseline", [(128, 1, "plain", 0, 99.0, True)])  # the cold run
    _report(tmp_path / "bench-fp8-baseline-run2", [(128, 1, "plain", 0, 10.0, True), (128, 1, "mtp", 3, 14.0, True)])
    _report(tmp_path / "bench-fp8-2", [(128, 1, "plain", 0, 9.0, True), (128, 1, "mtp", 3, 13.0, True)])
    _report(tmp_path / "bench-fp8-baseline-run3", [(128, 1, "plain", 0, 10.2, True), (128, 1, "mtp", 3, 14.0, True)])
    _report(tmp_path / "bench-fp8-2-run2", [(128, 1, "plain", 0, 9.2, True), (128, 1, "mtp", 3, 13.0, False)])
    table, settings, exact = collect(tmp_path, skip_first=("baseline",))
    assert settings == ["baseline", "2"] and not exact
    assert table["fp8", 128, 1, "plain", 0] == {"baseline": [10.0, 10.2], "2": [9.0, 9.2]}
    text = render(table, settings, exact)
    assert "10.00 / 10.20 | 9.00 / 9.20 | 0.9010" in text  # 9.1 / 10.1
    assert "mtp K=3 | 14.00 / 14.00 | 13.00 / 13.00 | 0.9286" in text
    assert text.endswith("every row of every run exact: False")
    assert collect(tmp_path)[0]["fp8", 128, 1, "plain", 0]["baseline"] == [99.0, 10.0, 10.2]
    assert collect(tmp_path, order=("2", "baseline", "2"))[1] == ["2", "baseline"]
