"""Choosing row buckets without a GPU: `benchmarks/gemm_buckets.py`'s `pick_buckets` over a sweep's times, with
each kernel's bucket list (the W8A8 kernel's keeps a bucket from 17 rows: its 27B plans run 16-row tiles below it)."""

import dataclasses
from pathlib import Path

import pytest
from helpers import benchmark_module

from qwen_mtp.ops import linear


@pytest.fixture(scope="module")
def gemm_buckets():
    return benchmark_module("gemm_buckets")


def _entry(times: dict) -> dict:
    return {"plans": {label: dict(plan=dataclasses.asdict(plan), us=us, equal=True, invariance_failures=[])
                      for label, (plan, us) in times.items()}}  # fmt: skip


def test_the_w8a8_sweep_keeps_a_32_row_bucket_from_17_rows(gemm_buckets):
    base = linear.gemm_plan_w8a8(34816, 5120)
    assert base.block_m == 16  # the 27B plan: 16-row tiles up to 16 rows
    bm32, bm64 = (dataclasses.replace(base, block_m=rows, row_tiles=1) for rows in (32, 64))
    entry = _entry({
        "now": (base, {32: 40.0, 64: 90.0, 96: 130.0, 128: 170.0, 256: 330.0}),
        "bm32": (bm32, {32: 30.0, 64: 70.0, 96: 110.0, 128: 150.0, 256: 310.0}),
        "bm64": (bm64, {32: 35.0, 64: 50.0, 96: 100.0, 128: 130.0, 256: 300.0}),
    })  # fmt: skip
    w8a8 = gemm_buckets.KINDS["w8a8"].buckets
    assert gemm_buckets.pick_buckets(entry, base, w8a8) == ((17, bm32), (33, bm64), (65, bm64), (129, bm64))
    bf16 = gemm_buckets.KINDS["bf16"].buckets
    assert gemm_buckets.pick_buckets(entry, base, bf16) == ((33, bm64), (65, bm64), (129, bm64))


def test_the_shipped_w8a8_tables_run_32_row_tiles_from_17_rows():
    """What the fourteenth session measured and shipped: per 27B FP8 shape, 16-row tiles up to 16 rows and the
    32-row plan from 17, summing alike (`check_row_buckets` at import)."""
    for (n, k), plan in linear.TUNED_W8A8.items():
        first, bucket = linear.W8A8_ROW_BUCKETS[n, k][0]
        assert (plan.block_m, first, bucket.block_m) == (16, 17, 32), (n, k)
        assert linear.same_sums(plan, bucket, n, k)


def _prefill_entry(times: dict, unequal: tuple = ()) -> dict:
    return {"plans": {label: {"us": us, "invariant": True, "equals_current": label not in unequal}
                      for label, us in times.items()}}  # fmt: skip


def test_prefill_buckets_start_where_another_plan_wins_by_more_than_the_margin():
    """`benchmarks/gemm_prefill.py`: the fastest plan at the fewest rows, then a bucket from the geometric middle
    below each measured M where another plan is faster than the current one by more than 3%; a plan whose bits
    differ from the current prefill plan's is never picked, however fast."""
    gemm_prefill = benchmark_module("gemm_prefill")
    rows = [512, 1024, 2048, 4096, 8192]
    entry = _prefill_entry(
        {
            "small": {512: 100.0, 1024: 190.0, 2048: 400.0, 4096: 820.0, 8192: 1700.0},
            "large": {512: 150.0, 1024: 200.0, 2048: 360.0, 4096: 700.0, 8192: 1400.0},
            "marginal": {512: 160.0, 1024: 230.0, 2048: 380.0, 4096: 710.0, 8192: 1372.0},  # 2% at 8192 only
            "other_bits": {512: 50.0, 1024: 90.0, 2048: 180.0, 4096: 350.0, 8192: 700.0},
        },
        unequal=("other_bits",),
    )
    assert gemm_prefill.pick_prefill_buckets(entry, rows) == ("small", ((1472, "large"),))  # sqrt(1024 x 2048)
    assert gemm_prefill.pick_prefill_buckets(_prefill_entry({"a": {512: 1.0}}, unequal=("a",)), [512]) == (None, ())


def test_prefill_apply_writes_the_bucketed_plans_into_both_tables(tmp_path):
    """`gemm_prefill.py --apply` on a copy of ops/linear.py: a shape whose bucketed dispatch kept its bits gets its
    base plan and buckets; one whose check failed gets its best plan and no buckets; the file still compiles."""
    gemm_prefill = benchmark_module("gemm_prefill")
    target = tmp_path / "linear.py"
    target.write_text(open(linear.__file__).read())
    small = dataclasses.asdict(linear.GemmPlan(128, 64, 80, 4, 4, family="tma", block_m=64))
    large = dataclasses.asdict(linear.GemmPlan(256, 64, 80, 8, 3, family="tma", block_m=128, persistent=True))
    plans = {"small": {"fields": small}, "large": {"fields": large}}
    shape = lambda n, ok: {"n": n, "k": 5120, "best": "large", "plans": plans,  # noqa: E731
                           "bucketed": {"base": "small", "buckets": [[1472, "large"]], "invariant": ok}}  # fmt: skip
    gemm_prefill.apply({"shapes": [shape(4096, True), shape(8192, False)]}, str(target))
    text = target.read_text()
    compile(text, str(target), "exec")
    namespace = {"GemmPlan": linear.GemmPlan}
    for name in ("PREFILL_TUNED", "PREFILL_ROW_BUCKETS"):
        start = text.index(f"\n{name}: dict")
        exec(text[start : text.index("\n}\n", start) + 3], namespace)
    assert namespace["PREFILL_TUNED"][4096, 5120] == linear.GemmPlan(**small)
    assert namespace["PREFILL_TUNED"][8192, 5120] == linear.GemmPlan(**large)
    assert namespace["PREFILL_ROW_BUCKETS"] == {(4096, 5120): ((1472, linear.GemmPlan(**large)),)}


def test_fp8_prefill_apply_writes_the_best_invariant_w8a8_plan(tmp_path):
    """`gemm_prefill_fp8.py --apply` on a copy of ops/linear.py: each shape's best invariant candidate goes into
    PREFILL_TUNED_W8A8, a shape with none keeps its entry, and the file still compiles; the module counts of
    one 27B FP8 forward are its 64 decoder layers' (48 GDN, 16 attention)."""
    gemm_prefill_fp8 = benchmark_module("gemm_prefill_fp8")
    counts = gemm_prefill_fp8.shape_counts("qwen3.5-27b-fp8")
    assert sum(counts.values()) == 48 * 2 + 16 * 2 + 64 * 2 and counts[5120, 6144] == 64
    target = tmp_path / "linear.py"
    target.write_text(open(linear.__file__).read())
    plan = linear.GemmPlan(128, 128, 40, 8, 3, family="tma", block_m=128, persistent=True)
    plans = {"128x128s3p": {"fields": dataclasses.asdict(plan)}}
    shapes = [{"n": 34816, "k": 5120, "best": "128x128s3p", "plans": plans}, {"n": 5120, "k": 6144, "best": None}]
    gemm_prefill_fp8.apply({"shapes": shapes}, str(target))
    text = target.read_text()
    compile(text, str(target), "exec")
    start = text.index("\nPREFILL_TUNED_W8A8: dict")
    namespace = {"GemmPlan": linear.GemmPlan}
    exec(text[start : text.index("\n}\n", start) + 3], namespace)
    assert namespace["PREFILL_TUNED_W8A8"] == linear.PREFILL_TUNED_W8A8 | {(34816, 5120): plan}


@pytest.mark.parametrize("kind", ["bf16", "w8a8"])
@pytest.mark.parametrize("splits", [4, 6, 8])
def test_the_split_sweep_cuts_a_shape_and_its_buckets_at_the_same_points(gemm_buckets, kind, splits):
    """`gemm_buckets.py --set splits`: the 27B down projection's plan and every row bucket cut into `splits` K
    pieces at the same columns (whatever each plan's K block), so the launch still sums alike at every M; the
    engine's tables hold them only inside `tables_as`."""
    k_ = gemm_buckets.KINDS[kind]
    n, k = 5120, 17408
    table = getattr(linear, k_.table)
    before = (k_.base(n, k), table[n, k])
    base, entries = gemm_buckets.resplit_tables(n, k, k_, splits)
    assert base.splits(k) == splits and len(entries) == len(before[1])
    assert all(linear.same_sums(plan, base, n, k) and plan.splits(k) == splits for _, plan in entries)
    assert [(fewest, dataclasses.replace(plan, k_per_split=0)) for fewest, plan in entries] == [
        (fewest, dataclasses.replace(plan, k_per_split=0)) for fewest, plan in before[1]
    ]  # only the split points change
    with gemm_buckets.tables_as(n, k, k_, base, entries):
        for m in (1, 16, 17, 33, 64, 65, 128, 200):
            plan = linear.row_plan(n, k, m, True, table, k_.base, {})
            assert plan.splits(k) == splits and linear.same_sums(plan, base, n, k), m
    assert (k_.base(n, k), table[n, k]) == before


@pytest.mark.parametrize("kind", ["bf16", "w8a8"])
def test_the_dispatch_table_times_every_shape_of_the_preset(gemm_buckets, kind, monkeypatch, tmp_path, capsys):
    """`gemm_buckets.py --set dispatch`: the engine's launch for each of the preset's shapes (no search), printed
    as x cuBLAS per M with the invariance verdict, and written out (the timing itself needs a GPU: faked here)."""
    import json
    import sys

    timed = []

    def fake_entry(n, k, kind_):
        timed.append((n, k))
        us = {m: 2.0 * m for m in gemm_buckets.DECODE_M}
        return dict(cublas_us={m: 1.0 * m for m in gemm_buckets.DECODE_M}, us=us, invariance_failures=[], plans={})

    monkeypatch.syspath_prepend(str(Path(gemm_buckets.__file__).parent))  # the shape lists import their siblings
    monkeypatch.setattr(gemm_buckets, "dispatch_entry", fake_entry)
    monkeypatch.setattr(gemm_buckets.torch.cuda, "get_device_name", lambda: "fake")
    out = tmp_path / "dispatch.json"
    monkeypatch.setattr(sys, "argv", ["gemm_buckets.py", "qwen3.5-27b", "--set", "dispatch", "--kind", kind,
                                      "--out", str(out)])  # fmt: skip
    gemm_buckets.main()
    listed = gemm_buckets.KINDS[kind].shapes("qwen3.5-27b", "")
    shapes = {name: nk for name, nk in listed.items() if "draft" not in name}
    assert sorted(timed) == sorted(shapes.values()) and len(shapes) >= 5
    report = json.loads(out.read_text())["shapes"]
    assert set(report) == set(shapes)
    printed = capsys.readouterr().out
    assert printed.count("  2.00") >= len(shapes) * len(gemm_buckets.DECODE_M) and printed.count(" inv") == len(shapes)


def test_the_one_row_line_is_fitted_through_the_shapes(gemm_buckets):
    """`one_row_line`: intercept us + bytes / rate by least squares over the shapes at M = 1, the lm_head left out,
    from a live report (int keys) or one read back from JSON (string keys)."""
    shapes = {"o_proj": (5120, 6144), "down": (5120, 17408), "gate_up": (34816, 5120), "lm_head": (248320, 5120)}

    def entry(n, k, string_keys=False):
        us = 3.0 + n * k / 1e6 / 2.5  # 3 us + one byte an element at 2.5 TB/s (MB / us)
        if (n, k) == shapes["lm_head"]:
            us *= 2  # off the line: must not count
        return dict(n=n, k=k, dispatch=dict(us={"1" if string_keys else 1: us}))

    for string_keys in (False, True):
        report = {name: entry(n, k, string_keys) for name, (n, k) in shapes.items()}
        intercept, rate = gemm_buckets.one_row_line(report, "us", weight_bytes=1)
        assert intercept == pytest.approx(3.0) and rate == pytest.approx(2.5)
    with pytest.raises(ValueError, match="two shapes"):
        gemm_buckets.one_row_line({"o_proj": entry(5120, 6144)}, "us", weight_bytes=1)
