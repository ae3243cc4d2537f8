"""`qwen-mtp bench` keeps what it measured: `bench.out_dir` is checked before the model loads, the JSON and
table are rewritten after every row (a failure late in a run keeps the rows before it), and the plot is
always drawn (matplotlib is a dependency)."""

import dataclasses
import json
from pathlib import Path

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
    calls, run = [], bench.timed_batch

    def failing_run(engine, prompts, output_len, oracles, sampled):
        calls.append(oracles is not None)
        if oracles is not None:
            raise RuntimeError("injected failure in the MTP row")
        return run(engine, prompts, output_len, oracles, sampled)

    monkeypatch.setattr(bench, "timed_batch", failing_run)
    with pytest.raises(RuntimeError, match="injected failure"):
        bench.run_bench(bench_recipe(tmp_path), progress=False, log=lambda _: None)
    assert calls == [False, False, True]  # plain warm-up and run, then the MTP row's warm-up
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["mode"], r["exact"]) for r in report["rows"]] == [("plain", True)]
    assert "plain" in (tmp_path / "bench.txt").read_text()
    assert report["package"] == str(Path(bench.__file__).resolve().parent)  # which tree ran (an A/B of two trees)


def test_a_full_run_writes_json_table_and_plot(tmp_path):
    report = bench.run_bench(bench_recipe(tmp_path), progress=False, log=lambda _: None)
    assert [(r["mode"], r["k"], r["exact"]) for r in report["rows"]] == [("plain", 0, True), ("mtp", 2, True)]
    assert report["mixed_steps"] is False  # `cache.mixed_steps` null, resolved on CPU: chunks unpacked
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == report["rows"]
    written = bench.write_outputs(report, tmp_path)
    assert [p.name for p in written] == ["bench.json", "bench.txt", "bench.png"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_penalized_rows_run_exact_and_bad_penalties_fail_before_loading(tmp_path):
    recipe = bench_recipe(tmp_path)
    recipe.bench.repetition_penalty, recipe.bench.frequency_penalty = 1.3, 0.5
    report = bench.run_bench(recipe, progress=False, log=lambda _: None)
    assert [(r["mode"], r["exact"]) for r in report["rows"]] == [("plain", True), ("mtp", True)]
    recipe.bench.frequency_penalty = 3.0
    with pytest.raises(RecipeError, match="frequency_penalty must be a number in"):
        bench.run_bench(recipe, progress=False, log=lambda _: None)


@pytest.mark.parametrize("k", [0, 2])
def test_step_bytes_count_weights_kv_and_recurrent_state(k):
    """The roofline's bytes, recomputed from the config: each request's keys and values once per target
    attention layer (and once per draft step for the MTP layer), its committed SSM state and conv window read
    and one SSM slot written per verified position, per GDN layer."""
    from qwen_mtp import Engine

    recipe = {"model": {"fixture": "tiny", "dtype": "bfloat16", "device": "cpu"}}
    if k:
        recipe["mtp"] = {"enabled": True, "k": k}
    engine = Engine.from_recipe(recipe, log=lambda _: None)
    c = engine.config
    weights = {"target": 1000, "mtp_step": 100}
    got = bench.step_bytes(engine, weights, batch=3, k=k, context=50.0)
    attention, gdn = c.layer_types.count("attn"), c.layer_types.count("gdn")
    per_position = 2 * c.num_key_value_heads * c.head_dim * 2  # keys and values, bf16
    slot = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4  # fp32 state
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    window = conv_dim * (c.linear_conv_kernel_dim - 1 + k) * 2
    assert got["weights"] == 1000 + k * 100
    assert got["kv"] == 3 * 50.0 * per_position * (attention + k * c.mtp_num_hidden_layers)
    assert got["state"] == 3 * gdn * (slot * (2 + k) + window)


def test_a_context_sweep_runs_every_prompt_length(tmp_path):
    """`bench.prompt_len` as a list: one set of rows per context length, each exact, and a plot with the
    context panel."""
    recipe = bench_recipe(tmp_path)
    recipe.bench.prompt_len, recipe.bench.ks = [4, 9], [2]
    report = bench.run_bench(recipe, progress=False, log=lambda _: None)
    cases = [(r["prompt_len"], r["mode"]) for r in report["rows"]]
    assert cases == [(4, "plain"), (4, "mtp"), (9, "plain"), (9, "mtp")]
    assert all(r["exact"] for r in report["rows"])
    assert bench.write_outputs(report, tmp_path)[-1].stat().st_size > 0


def test_a_batch_sweep_with_k_auto_and_draft_vocabularies(tmp_path):
    """`bench.ks` with auto and `bench.draft_vocabs`: the MTP rows once per draft vocabulary (the first N ids,
    as for synthetic models), each exact, with the mean K verified; the plot draws the k auto rows."""
    recipe = load_recipe(
        {
            "model": {"fixture": "tiny", "dtype": "float32", "device": "cpu"},
            "mtp": {"max_k": 3, "draft_vocab_file": "first"},
            "bench": {"batch_sizes": [1, 2], "ks": ["auto"], "accept_rates": [0.8], "head": False,
                      "draft_vocabs": [0, 32], "prompt_len": 8, "output_len": 6, "out_dir": str(tmp_path)},
        }
    )  # fmt: skip
    report = bench.run_bench(recipe, progress=False, log=lambda _: None)
    rows = [(r["batch"], r["mode"], r["k"], r["draft_vocab"]) for r in report["rows"]]
    assert rows == [(b, *row) for b in (1, 2) for row in [("plain", 0, 0), ("mtp", "auto", 0), ("mtp", "auto", 32)]]
    assert all(r["exact"] for r in report["rows"])
    assert all(0 <= r["mean_k"] <= 3 for r in report["rows"] if r["mode"] == "mtp")
    # what the policy weighed: its step times at the row's batch for K = 0..3 (plain rows: none)
    assert all(r["k_step_ms"] is None for r in report["rows"] if r["mode"] == "plain")
    assert all(len(r["k_step_ms"]) == 4 and min(r["k_step_ms"]) > 0 for r in report["rows"] if r["mode"] == "mtp")
    # k auto's steps run ahead of the step before them (cache.lookahead) while K stays, as the plain rows' do
    assert all(r["ahead_pct"] > 0 for r in report["rows"]), [r["ahead_pct"] for r in report["rows"]]
    assert bench.write_outputs(report, tmp_path)[-1].stat().st_size > 0
    assert "auto" in (tmp_path / "bench.txt").read_text()


def test_draft_lm_heads_run_the_mtp_rows_once_per_head(tmp_path):
    """`bench.draft_lm_heads: [bf16, fp8]`: the MTP rows once per draft lm_head (each with every draft
    vocabulary), each exact, and the table names the head."""
    recipe = load_recipe(
        {
            "model": {"fixture": "tiny", "dtype": "float32", "device": "cpu"},
            "mtp": {"draft_vocab_file": "first"},
            "bench": {"batch_sizes": [1], "ks": [2], "accept_rates": [0.8], "head": True, "draft_vocabs": [0, 200],
                      "draft_lm_heads": ["bf16", "fp8"], "prompt_len": 8, "output_len": 4, "out_dir": str(tmp_path)},
        }
    )  # fmt: skip
    report = bench.run_bench(recipe, progress=False, log=lambda _: None)
    rows = [(r["mode"], r["draft"], r["draft_vocab"], r["draft_lm_head"]) for r in report["rows"]]
    assert rows == [("plain", "-", 0, "-")] + [
        ("mtp", draft, vocab, head) for head in ("bf16", "fp8") for vocab in (0, 200) for draft in ("oracle", "head")
    ]
    assert all(r["exact"] for r in report["rows"])
    assert "fp8" in (tmp_path / "bench.txt").read_text()


def test_a_prompt_past_max_prefill_chunk_prefills_in_chunks(tmp_path, monkeypatch):
    """A 20-token prompt with `bench.max_prefill_chunk` 8 (above `cache.prefill_chunk`): three prefill steps, then
    the decode steps alone are counted as decode (output_len 4: three after the first token); the MTP row is still
    exact."""
    recipe = bench_recipe(tmp_path)
    recipe.bench.prompt_len, recipe.bench.max_prefill_chunk, recipe.cache.prefill_chunk = 20, 8, 4
    chunks, runs, run = [], [], bench.timed_batch

    def recording_run(engine, prompts, output_len, oracles, sampled):
        chunks.append(engine.scheduler.prefill_chunk)
        runs.append(run(engine, prompts, output_len, oracles, sampled))
        return runs[-1]

    monkeypatch.setattr(bench, "timed_batch", recording_run)
    report = bench.run_bench(recipe, progress=False, log=lambda _: None)
    assert set(chunks) == {8}
    assert runs[1]["decode_steps"] == 3  # the plain row's timed run: one token a step
    assert [(r["mode"], r["exact"]) for r in report["rows"]] == [("plain", True), ("mtp", True)]


def test_tpot_counts_the_decode_phase_only():
    """Every first token in one step: the usual (end - first) / (tokens - 1). First tokens in different steps (mixed
    steps prefill the later prompts while the earlier ones decode): each request's tokens after the last first token
    only, so a prefill step is not counted as a decode step of the request that came first."""
    assert bench.decode_tpot([0.7, 0.7], [7, 7]) == pytest.approx(0.1)
    assert bench.decode_tpot([0.3, 0.6], [3, 6]) == pytest.approx(0.1)  # the first to start also ends first
    assert bench.decode_tpot([0.6, 0.6], [3, 6]) == pytest.approx((0.2 + 0.1) / 2)
    assert bench.decode_tpot([-0.1, 0.5], [0, 5]) == pytest.approx(0.1)  # a request done before the decode phase
    assert bench.decode_tpot([0.0], [0]) == 0.0


@pytest.mark.parametrize(
    ("batch", "prompt_len", "chunk", "step_tokens", "shape"),
    [
        (32, 128, 128, 8192, (32, 128)),  # short prompts: the timed batch, packed as the timed run packs it
        (8, 2048, 2048, 8192, (8, 2048)),
        (8, 32768, 32768, 32800, (2, 32768)),  # one chunk a step: two requests run every step shape
        (1, 131072, 32768, 32772, (1, 65536)),  # a first chunk and one with context before it
        (4, 20, 8, 8, (2, 16)),
    ],
)
def test_warmup_runs_the_timed_step_shapes_without_a_second_long_prefill(batch, prompt_len, chunk, step_tokens, shape):
    assert bench.warmup_shape(batch, prompt_len, chunk, step_tokens) == shape


def test_mixed_steps_with_staggered_first_tokens_time_the_decode_phase(tmp_path, monkeypatch):
    """Mixed steps with a budget of one chunk: the second prompt prefills while the first decodes, so the first
    request's decode-phase tokens are fewer than its output; the rows stay exact."""
    recipe = bench_recipe(tmp_path)
    recipe.bench.batch_sizes, recipe.bench.prompt_len, recipe.bench.output_len = [2], 12, 6
    recipe.bench.max_prefill_chunk = recipe.cache.prefill_chunk = 8
    recipe.cache.mixed_steps, recipe.cache.max_step_tokens = True, 2 * 3 + 8
    runs, run = [], bench.timed_batch

    def recording_run(engine, prompts, output_len, oracles, sampled):
        runs.append(run(engine, prompts, output_len, oracles, sampled))
        return runs[-1]

    monkeypatch.setattr(bench, "timed_batch", recording_run)
    report = bench.run_bench(recipe, progress=False, log=lambda _: None)
    timed = runs[1]  # the plain row's timed run
    assert timed["decode_tokens"][0] < 5 and timed["decode_tokens"][1] == 5, timed["decode_tokens"]
    assert 0 < timed["tpot"] <= timed["decode_seconds"] / min(timed["decode_tokens"])
    assert report["mixed_steps"] is True
    assert [(r["mode"], r["exact"]) for r in report["rows"]] == [("plain", True), ("mtp", True)]


def _row(batch, k, tokens_per_s, tpot_ms, accept_rate=0.8, mode=None):
    mode = mode or ("plain" if k == 0 else "mtp")
    draft = "-" if mode == "plain" else "oracle"
    return {**{field.name: 0.0 for field in dataclasses.fields(bench.Row)}, **dict(
        prompt_len=128, batch=batch, mode=mode, k=k, draft=draft, accept_rate=None if mode == "plain" else accept_rate,
        draft_vocab=0, draft_lm_head="-" if mode == "plain" else "bf16", mean_k=3.0 if k == "auto" else float(k),
        tokens_per_s=tokens_per_s, tpot_ms=tpot_ms, exact=True,
    )}  # fmt: skip


def test_k_auto_is_reported_against_the_best_of_plain_and_fixed_k(tmp_path):
    """Issue #16's figure in the report: each k auto row against its own batch's plain and fixed-K rows (not
    another batch's, not another accept rate's), by tokens/s and by TPOT, which may pick different K."""
    rows = [
        _row(4, 0, 400.0, 10.0), _row(4, 3, 800.0, 5.0), _row(4, 4, 790.0, 4.9), _row(4, "auto", 780.0, 5.0),
        _row(4, 2, 900.0, 4.0, accept_rate=1.0),  # another accept rate: not a neighbour
        _row(8, 3, 2000.0, 4.0),  # another batch: not a neighbour
        _row(64, 0, 3000.0, 20.0), _row(64, 3, 2900.0, 21.0), _row(64, "auto", 3000.0, 20.0),
        _row(16, 0, 1000.0, 15.0), _row(16, "auto", 1000.0, 15.0),  # no fixed K ran: no verdict
    ]  # fmt: skip
    b4, b64 = bench.k_auto_against_fixed(rows)
    assert (b4["batch"], b4["best_k_tokens_per_s"], b4["best_k_tpot"]) == (4, 3, 4)
    assert b4["behind_tokens_per_s"] == pytest.approx(1 - 780 / 800) and b4["behind_tpot"] == pytest.approx(5 / 4.9 - 1)
    assert (b64["best_k_tokens_per_s"], b64["behind_tokens_per_s"], b64["behind_tpot"]) == (0, 0.0, 0.0)
    report = {"rows": rows}
    bench.write_outputs(report, tmp_path, plot=False)
    assert len(json.loads((tmp_path / "bench.json").read_text())["k_auto"]) == 2
    text = (tmp_path / "bench.txt").read_text()
    assert "B4 (oracle 0.8, mean K 3.00): +2.5% tok/s behind the best of plain and fixed K (K=3)" in text
