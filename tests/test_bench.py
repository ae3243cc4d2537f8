"""`qwen-mtp bench` keeps what it measured: `bench.out_dir` is checked before the model loads, the JSON and
table are rewritten after every row (a failure late in a run keeps the rows before it), and the plot is
always drawn (matplotlib is a dependency)."""

import json

import pytest

from qwen_mtp import RecipeError, bench
from qwen_mtp.recipe import load_recipe


def bench_recipe(out_dir):
    return load_recipe(
        {
            "model": {"fixture": "tiny", "dtype": "float32", "device": "cpu"},
            "bench": {
                "batch_sizes": [1],
                "ks": [2],
                "accept_rates": [1.0],
                "head": False,
                "prompt_len": 8,
                "output_len": 4,
                "out_dir": str(out_dir),
            },
        }
    )


def test_unwritable_out_dir_fails_before_the_first_run(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")

    def load_from_recipe(*args, **kwargs):
        raise AssertionError("the model was loaded before bench.out_dir was checked")

    monkeypatch.setattr(bench, "load_from_recipe", load_from_recipe)
    with pytest.raises(RecipeError, match=r"bench.out_dir '.*a-file/results' is not writable"):
        bench.run_bench(bench_recipe(tmp_path / "a-file" / "results"), progress=False, log=lambda _: None)


def test_rows_are_written_as_they_come(tmp_path, monkeypatch):
    """The MTP row fails: the plain row measured before it is on disk, in the JSON and the table."""
    calls, run = [], bench._run

    def failing_run(engine, prompts, output_len, oracles):
        calls.append(oracles is not None)
        if oracles is not None:
            raise RuntimeError("injected failure in the MTP row")
        return run(engine, prompts, output_len, oracles)

    monkeypatch.setattr(bench, "_run", failing_run)
    with pytest.raises(RuntimeError, match="injected failure"):
        bench.run_bench(bench_recipe(tmp_path), progress=False, log=lambda _: None)
    assert calls == [False, False, True]  # plain warm-up and run, then the MTP row's warm-up
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["mode"], r["exact"]) for r in report["rows"]] == [("plain", True)]
    assert "plain" in (tmp_path / "bench.txt").read_text()


def test_a_full_run_writes_json_table_and_plot(tmp_path):
    report = bench.run_bench(bench_recipe(tmp_path), progress=False, log=lambda _: None)
    assert [(r["mode"], r["k"], r["exact"]) for r in report["rows"]] == [("plain", 0, True), ("mtp", 2, True)]
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == report["rows"]
    written = bench.write_outputs(report, tmp_path)
    assert [p.name for p in written] == ["bench.json", "bench.txt", "bench.png"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
