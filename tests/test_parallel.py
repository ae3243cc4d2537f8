"""Tensor parallel on CPU: two gloo ranks (spawned once for the module, see parallel_workers.py) against MTP off,
TP=1 and Hugging Face; the loader's per-rank slices; the errors a user can meet before any rank starts."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from pathlib import Path

import parallel_workers
import pytest
import torch
from helpers import hf_greedy_with_margins, load_hf, random_prompt, reference_lltokenizer, wait_gone
from typer.testing import CliRunner

from qwen_mtp import Engine, load_model
from qwen_mtp import loader as loader_module
from qwen_mtp.cli import app
from qwen_mtp.config import ModelConfig
from qwen_mtp.engine.setup import LoadedModel
from qwen_mtp.errors import CheckpointError, ConfigError, RecipeError
from qwen_mtp.model.shapes import RankShapes
from qwen_mtp.parallel import ShardPlan, TensorParallel
from qwen_mtp.parallel.launch import check_recipe, spawn_ranks
from qwen_mtp.recipe import load_recipe

# GQA 4/2 (one KV head per rank), MQA (the KV head replicated on both ranks), Qwen3.5-MoE (3-D expert tensors) and
# Qwen3-Next (per-expert tensors, interleaved GDN projections, a dense layer among the MoE ones)
PRESETS = ("tiny", "tiny-8l", "tiny-moe", "tiny-next")
MAX_NEW = 16
TIMEOUT_S = 10.0  # the ranks' process-group timeout
DEADLINE_S = 420.0  # the whole spawn (~110 s on 2 busy cores), so that a bug cannot hang CI
DRAFT_NEAR_TIES = 2  # accepted drafts TP=2 may differ from TP=1 by, of ~30 (flipped near-ties; 0 measured)
SMALL = Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small"  # the trained model: its drafts are accepted
SMALL_PROMPTS = ["import os\n\ndef ", "class Stack:\n    def push(self, item):\n", "for i in range(10):\n"]

# Across TP degrees the row-parallel products are two partial sums added, not one sum: the logits round
# differently, so a greedy token may differ where the top-2 logits nearly tie. A near-tie: at the first position
# where TP=2 and the reference differ, the reference's top-1 minus top-2 logit is below this many fp32 ulps (at the
# top logit's magnitude; 2^-23 relative each). The tiny models' logits move by a few ulps between degrees.
TP_NEAR_TIE_ULPS = 256.0


def tp2_turns() -> list[list[int]]:
    """The messages of the prefix-caching conversation the ranks hold (`parallel_workers.prefix_cached`)."""
    return [random_prompt(6, seed=10 + t) for t in range(4)]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    # 40 tokens: three prefill chunks of 16 (the ranks run with cache.prefill_chunk 16)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 40, 3)]


@pytest.fixture(scope="module")
def tp2(checkpoint, tmp_path_factory):
    """Spawn the two ranks once; while they run, compute TP=1 and HF tokens here. Yields what both produced."""
    out = tmp_path_factory.mktemp("tp2")
    paths = {preset: checkpoint(preset) for preset in PRESETS}
    spec = {"out": str(out), "checkpoints": {p: str(path) for p, path in paths.items()}, "prompts": prompts()}
    spec.update(max_new_tokens=MAX_NEW, compiled=PRESETS[0], small_model=str(SMALL), small_prompts=SMALL_PROMPTS)
    spec["turns"] = tp2_turns()
    (out / "spec.json").write_text(json.dumps(spec))
    started = time.monotonic()
    ranks = spawn_ranks(2, "gloo", TIMEOUT_S, parallel_workers.tp_checks, (str(out / "spec.json"),))
    exited_at = [None, None]  # when each rank's process ended, watched while the references below compute

    def watch() -> None:
        while None in exited_at and time.monotonic() - started < DEADLINE_S:
            for r, process in enumerate(ranks.processes):
                if exited_at[r] is None and process.exitcode is not None:
                    exited_at[r] = time.time()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        reference = {}
        for preset, path in paths.items():
            engine = Engine.from_recipe({"model": {"path": str(path), "device": "cpu", "dtype": "float32"}})
            tp1 = [r.token_ids for r in engine.generate(prompts(), max_new_tokens=MAX_NEW, ignore_eos=True)]
            hf = load_hf(path, torch.float32)
            reference[preset] = {"tp1": tp1, "hf": [hf_greedy_with_margins(hf, p, MAX_NEW, None) for p in prompts()]}
        reference["draft_heads"] = parallel_workers.draft_head_runs(str(SMALL), SMALL_PROMPTS, 1)
        reference["sampled"] = parallel_workers.sampled_runs(str(SMALL), SMALL_PROMPTS, 1)
        watcher.join()
        results = [
            json.loads((out / f"rank{r}.json").read_text()) for r in range(2) if (out / f"rank{r}.json").exists()
        ]
        yield {
            "ranks": results,
            "reference": reference,
            "exited_at": exited_at,
            "exit_codes": [p.exitcode for p in ranks.processes],
            "killed_at": float((out / "killed_at").read_text()) if (out / "killed_at").exists() else None,
            "rank0_stderr": (out / "rank0.err").read_text() if (out / "rank0.err").exists() else "",
        }
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def rank_results(tp2) -> list[dict]:
    assert len(tp2["ranks"]) == 2, f"the ranks did not finish their checks; rank 0 said:\n{tp2['rank0_stderr']}"
    return tp2["ranks"]


def test_tp2_ranks_agree_on_every_token(tp2):
    first, second = rank_results(tp2)
    assert first == second


@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_mtp_gives_exactly_the_mtp_off_tokens(tp2, preset):
    run = rank_results(tp2)[0][preset]
    assert run["mtp"] == run["off"]  # MTP K=2, the three prompts batched
    assert run["mtp_alone"] == run["off"]  # each alone: no dependence on the batch
    assert run["busy"] == run["off"]  # K=3 on two state rows, arrivals, a cancellation and its re-admission
    if preset == PRESETS[0]:  # torch.compile(fullgraph) with the collectives inside the steps
        assert run["mtp_compiled"] == run["off"]


def test_tp2_draft_heads_on_vocabulary_shards_give_the_mtp_off_tokens(tp2):
    """`mtp.draft_vocab` and `mtp.draft_lm_head: fp8` at TP=2 (each rank scores its part of the draft ids, possibly
    none, or an FP8 copy of its shard): MTP-off's tokens, and a draft vocabulary of every id drafts as the lm_head."""
    runs = rank_results(tp2)[0]["draft_heads"]
    accepted = {name: run["accepted"] for name, run in runs.items()}
    for name, run in runs.items():
        assert run["tokens"] == runs["off"]["tokens"], name
    assert accepted["every_id"] == accepted["lm_head"], accepted  # the same drafts, chosen across the ranks
    # TP=1 drafts the same up to the near-ties that rounding across degrees can flip (none on this machine: equal)
    tp1 = {name: run["accepted"] for name, run in tp2["reference"]["draft_heads"].items()}
    assert all(abs(accepted[name] - tp1[name]) <= DRAFT_NEAR_TIES for name in accepted), (accepted, tp1)


def test_tp2_sampling_penalties_and_logprobs_equal_with_mtp_and_tp1(tp2):
    """Sampled requests at TP=2 (temperature with top-k / top-p / min-p, penalties, logit bias, min_tokens, logprobs
    and prompt logprobs, each request its own mix; the whole vocabulary gathered on every rank): MTP K=2 gives
    MTP-off's tokens and logprobs, and TP=1's tokens, logprobs within fp32 rounding of the degrees' sums."""
    runs = rank_results(tp2)[0]["sampled"]
    reference = tp2["reference"]["sampled"]
    assert runs["mtp"] == runs["off"]  # tokens, logprobs and the top ids, exactly
    assert [tokens for tokens, _, _ in runs["off"]] == [tokens for tokens, _, _ in reference["off"]]
    for (_, ours, _), (_, theirs, _) in zip(runs["off"], reference["off"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)
    lengths = [len(logprobs) for _, logprobs, _ in runs["off"]]  # asked: prompt and output, none, output
    assert lengths[0] > 24 and lengths[1:] == [0, 24], lengths


def test_tp2_k_auto_agrees_across_ranks_and_gives_the_mtp_off_tokens(tp2):
    """`mtp.k: auto` at TP=2 with each rank measuring other step times: the ranks choose the same K every step (from
    the slowest rank's times), drafts are verified, and the tokens are MTP-off's."""
    first, second = (ranks["k_auto"] for ranks in rank_results(tp2))
    assert first["k"] == second["k"] and first["k"], (first["k"], second["k"])
    assert max(first["k"]) == 2, first["k"]  # rank 1's times (K = 3 costs three plain steps) rule
    off = rank_results(tp2)[0]["draft_heads"]["off"]["tokens"]
    assert first["tokens"] == off
    # K = 0 for three requests, then K > 0 for the two left (a packed catch-up of both): still MTP-off's tokens
    assert first["rise_k"] == second["rise_k"] and 0 in first["rise_k"] and max(first["rise_k"]) > 0, first["rise_k"]
    assert first["rise_tokens"] == [tokens[:n] for tokens, n in zip(off, (24, 16, 6), strict=True)]


@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_tokens_equal_tp1_and_hf_up_to_near_ties(tp2, preset):
    ours = rank_results(tp2)[0][preset]["off"]
    reference = tp2["reference"][preset]
    compared = 0
    for b, (tokens, tp1, (hf, margins)) in enumerate(zip(ours, reference["tp1"], reference["hf"], strict=True)):
        assert tp1 == hf, f"prompt {b}: TP=1 {tp1} != HF {hf} (fp32 must be exact)"
        differ = next((i for i, (a, e) in enumerate(zip(tokens, hf, strict=True)) if a != e), len(hf))
        if differ < len(hf):
            assert margins[differ] < TP_NEAR_TIE_ULPS, (
                f"prompt {b}: TP=2 {tokens} != TP=1/HF {hf} at {differ}, where HF's top-2 margin is "
                f"{margins[differ]:.0f} fp32 ulps: not a near-tie (< {TP_NEAR_TIE_ULPS:.0f})"
            )
        compared += differ
    assert compared >= len(ours) * MAX_NEW // 2, "too few tokens compared before a near-tie"


@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_structured_outputs_obey_their_grammar_with_mtp_as_without(tp2, checkpoint, preset):
    """Greedy constrained generations at TP=2 (each rank masks its own vocabulary ids): every token is one the
    grammar allows (a fresh llguidance matcher consumes them all), and MTP K=2 gives MTP-off's tokens."""
    import llguidance

    run = rank_results(tp2)[0][preset]
    assert run["constrained_mtp"] == run["constrained_off"]
    _, lltokenizer = reference_lltokenizer(checkpoint(preset))
    grammar = llguidance.LLMatcher.grammar_from_regex(parallel_workers.STRUCTURED_REGEX)
    for tokens, free in zip(run["constrained_off"], run["off"], strict=True):
        matcher = llguidance.LLMatcher(lltokenizer, grammar)
        assert matcher.try_consume_tokens(tokens) == len(tokens) and tokens != free, tokens


def test_vocab_parallel_argmax_breaks_ties_to_the_lowest_id_as_torch_argmax(tp2):
    chosen, expected = rank_results(tp2)[0]["vocab_argmax"]
    assert chosen == expected


def test_rank_order_sum_equals_the_all_reduce_at_two_ranks(tp2):
    assert all(r["sum_in_rank_order"] for r in rank_results(tp2))


def test_killing_a_rank_ends_the_other_within_the_timeout(tp2):
    assert tp2["killed_at"] is not None, f"rank 1 never reached its kill; rank 0 said:\n{tp2['rank0_stderr']}"
    assert tp2["exit_codes"][1] == -9
    assert tp2["exit_codes"][0] == 1, f"rank 0 did not fail on its own: {tp2['exit_codes']}"
    assert tp2["exited_at"][0] - tp2["killed_at"] < TIMEOUT_S
    assert "rank 0 of 2 stopped" in tp2["rank0_stderr"]
    assert "parallel.timeout_s" in tp2["rank0_stderr"]


# ---- the loader: each rank reads only its slices ------------------------------------------------------------


class CountingHandle:
    """A safetensors handle that counts the bytes each read returns (whole tensors and slices)."""

    def __init__(self, handle, counts):
        self.handle, self.counts = handle, counts

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def _count(self, name, tensor):
        self.counts[name] = self.counts.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def get_tensor(self, name):
        return self._count(name, self.handle.get_tensor(name))

    def get_slice(self, name):
        handle = self

        class Slice:
            def __getitem__(self, index):
                return handle._count(name, handle.handle.get_slice(name)[index])

        return Slice()


@pytest.mark.parametrize("preset", PRESETS)
def test_loader_reads_only_each_ranks_slices(checkpoint, monkeypatch, preset):
    path = checkpoint(preset)
    full = load_model(path).state_dict()
    opened = loader_module._open
    totals = []
    for rank in range(2):
        counts: dict[str, int] = {}
        monkeypatch.setattr(loader_module, "_open", lambda file, c=counts: CountingHandle(opened(file), c))
        model = load_model(path, parallel=TensorParallel(rank, 2, rank, None))
        plan = ShardPlan(model.config, 2, rank)
        read: dict[str, int] = {}
        for name, size in counts.items():  # a per-expert tensor's bytes count toward the 3-D weight it fills
            read[filled_weight(name)] = read.get(filled_weight(name), 0) + size
        for name, tensor in model.state_dict().items():
            shard = plan.shard(name)
            expected = full[name] if shard is None else shard.read(full[name])
            assert torch.equal(tensor, expected), f"rank {rank}: {name} is not its slice of the checkpoint"
            # bytes read from disk for this tensor: exactly the rank's part (fp32 on disk and in the model)
            assert read[name] == expected.numel() * expected.element_size(), name
        assert sum(read.values()) == sum(t.numel() * t.element_size() for t in model.state_dict().values())
        totals.append(sum(counts.values()))
    whole = sum(t.numel() * t.element_size() for t in full.values())
    assert max(totals) < 0.6 * whole  # replicated norms, fc and (tiny-8l) KV heads are what exceeds half


PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def filled_weight(name: str) -> str:
    """The model tensor checkpoint tensor `name` fills: a per-expert tensor fills its 3-D expert weight."""
    match = PER_EXPERT.search(name)
    if match is None:
        return name
    return name[: match.start()] + (".experts.down_proj" if match[1] == "down" else ".experts.gate_up_proj")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor `torch.equal` can compare: e4m3 as its bytes."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


# head dims of 128 (and MoE widths of 256): every TP=2 shard boundary falls on a 128-wide scale block
ALIGNED = {"head_dim": 128, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
ALIGNED_MOE = {**ALIGNED, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}
FP8_CHECKPOINTS = {
    "dense": ("tiny-fp8", {}),
    "moe-per-expert": ("tiny-moe-fp8", {"experts": "per_expert", **ALIGNED_MOE}),  # as Qwen's FP8 releases
    "moe-fused": ("tiny-moe-fp8", {"experts": "fused", **ALIGNED_MOE}),  # Hugging Face's FP8Experts
}


@pytest.mark.parametrize("kind", FP8_CHECKPOINTS)
@pytest.mark.parametrize("quant", ["none", "dequantize"])
def test_fp8_scales_are_sliced_with_their_blocks(checkpoint, quant, kind):
    """Each rank holds its slice of every tensor: FP8 projections and experts kept in FP8 (quant none: the e4m3
    weight and its 128-row/column blocks of `weight_scale_inv`) or dequantized at load, exactly as the whole
    model does."""
    preset, options = FP8_CHECKPOINTS[kind]
    path = checkpoint(preset, fp8=True, **(ALIGNED | options))
    full = load_model(path, quant=quant).state_dict()
    kept = [name for name, tensor in full.items() if tensor.dtype == torch.float8_e4m3fn]
    assert bool(kept) == (quant == "none")
    for rank in range(2):
        model = load_model(path, quant=quant, parallel=TensorParallel(rank, 2, rank, None))
        plan = ShardPlan(model.config, 2, rank)
        sharded_scales = 0
        for name, tensor in model.state_dict().items():
            if name.endswith("_scale_inv"):
                shard = plan.shard(name[: -len("_scale_inv")])
                shard = None if shard is None else shard.blocks(128)
                sharded_scales += shard is not None
            else:
                shard = plan.shard(name)
            expected = full[name] if shard is None else shard.read(full[name])
            assert tensor.dtype == expected.dtype, name  # FP8 where the whole model is FP8
            assert torch.equal(bits(tensor), bits(expected)), name
        assert (sharded_scales > 0) == (quant == "none")


def test_fp8_shard_boundary_off_the_128_blocks_is_refused(checkpoint):
    path = checkpoint("tiny-fp8", fp8=True)  # head_dim 64: TP=2 splits k_proj's 128 rows at 64
    with pytest.raises(CheckpointError, match=r"fp8 tensor \S+\.weight: parallel.tp=2 splits its rows .* 128-wide"):
        load_model(path, parallel=TensorParallel(1, 2, 1, None))
    # experts 128 wide: TP=2 splits each expert's gate and up rows (dim 1 of [E, 2I, H]) and down columns at 64
    path = checkpoint("tiny-moe-fp8", fp8=True, experts="fused", **ALIGNED)
    refused = r"fp8 tensor \S+\.experts\.(gate_up_proj: \S+ splits its rows|down_proj: \S+ splits its columns)"
    with pytest.raises(CheckpointError, match=refused):
        load_model(path, parallel=TensorParallel(0, 2, 0, None))


# ---- errors before any rank starts --------------------------------------------------------------------------


def test_heads_tp2_cannot_divide_give_a_clear_error(checkpoint, tmp_path):
    path = checkpoint("tiny", linear_num_key_heads=1, linear_num_value_heads=3)
    with pytest.raises(ConfigError, match=r"degree 2 does not divide linear_num_key_heads=1"):
        load_model(path, parallel=TensorParallel(0, 2, 0, None))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {path}, device: cpu}}\nparallel: {{tp: 2}}\n")
    result = CliRunner().invoke(app, ["run", str(recipe)])  # refused before any rank is spawned
    assert result.exit_code == 2
    assert "parallel.tp: tensor parallel degree 2 does not divide linear_num_key_heads=1" in result.output


def test_kv_heads_are_replicated_when_fewer_than_ranks_and_refused_when_uneven(checkpoint):
    config = ModelConfig.from_pretrained(checkpoint("tiny"))
    wide = dataclasses.replace(
        config, vocab_size=768, num_attention_heads=12, num_key_value_heads=4, linear_num_key_heads=12,
        linear_num_value_heads=24, intermediate_size=120,
    )  # fmt: skip
    assert RankShapes.of(wide, 12).kv_heads == 1  # 4 KV heads, 12 ranks: each KV head serves three ranks
    assert ShardPlan(wide, 12, 5).shard("model.layers.3.self_attn.k_proj.weight").ranges == ((32, 64),)  # head 1
    with pytest.raises(ConfigError, match="KV heads cannot be replicated evenly"):
        RankShapes.of(wide, 6)
    with pytest.raises(RecipeError, match="parallel.tp: tensor parallel degree 3 does not divide"):
        check_recipe(load_recipe({"model": {"fixture": "tiny", "device": "cpu"}, "parallel": {"tp": 3}}))


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    recipe = load_recipe({"model": {"synthetic": "qwen3.5-0.8b", "device": "cuda"}, "parallel": {"tp": 2}})
    with pytest.raises(RecipeError, match="parallel.tp=2 needs 2 GPUs, one per rank, but 1 are visible"):
        check_recipe(recipe)


# ---- what tensor parallelism cannot combine with yet: refused, never run wrong ------------------------------


def rank_engine(checkpoint, **sections) -> Engine:
    """An engine over rank 0's TP=2 shard without a process group: enough for the checks a recipe or request
    meets before any step runs (no collective is called)."""
    path = checkpoint("tiny")
    model = load_model(path, dtype=torch.float32, parallel=TensorParallel(0, 2, 0, None))
    model.parallel = TensorParallel(0, 2, 0, None)  # what apply_tensor_parallel sets inside started ranks
    return Engine(LoadedModel(model, None, path, torch.device("cpu")), **sections)


def test_tp2_prefix_caching_restores_each_ranks_state_and_gives_the_cold_tokens(tp2):
    """A conversation at TP=2 with MTP K=2: with prefix caching every turn's tokens and drafts equal a cold run's,
    each turn after the first restores the history's full chunks (on both ranks, their own KV heads and GDN
    state), and clearing the cache gives every page and snapshot slot back."""
    runs = [ranks["prefix_cache"] for ranks in rank_results(tp2)]
    assert runs[0] == runs[1]
    run = runs[0]
    assert [turn[:2] for turn in run["cached"]] == [turn[:2] for turn in run["cold"]]  # tokens and every draft
    chunk = parallel_workers.PREFIX_CHUNK
    history = 0
    for t, (output, _, restored) in enumerate(run["cached"]):
        if t:
            assert restored == (history - 1) // chunk * chunk, (t, restored)
        history += len(tp2_turns()[t]) + len(output)
    assert run["stats"]["prefix_hits"] == len(run["cached"]) - 1
    cleared = run["stats_cleared"]
    assert run["evicted"] > 0 and cleared["free_pages"] == cleared["total_pages"]
    assert cleared["prefix_free_snapshot_slots"] == cleared["prefix_snapshot_slots"]


def test_the_server_refuses_a_degree_the_model_cannot_split_before_any_rank_starts(tmp_path):
    file = tmp_path / "serve.yaml"
    file.write_text("model: {fixture: tiny, device: cpu}\nparallel: {tp: 3}\n")
    result = CliRunner().invoke(app, ["serve", str(file)])
    assert result.exit_code == 2
    assert "parallel.tp: tensor parallel degree 3 does not divide" in result.output


def test_an_engine_outside_started_ranks_says_how_to_start_them():
    with pytest.raises(RecipeError, match="torchrun --nproc-per-node 2"):
        Engine.from_recipe({"model": {"fixture": "tiny", "device": "cpu"}, "parallel": {"tp": 2}})


def test_qwen_mtp_run_starts_two_ranks_and_rank_0_prints(tp2, checkpoint, tmp_path):
    """`qwen-mtp run` with parallel.tp=2 spawns the ranks itself; only rank 0 prints, and its MTP tokens are the
    TP=2 MTP-off tokens of the spawned check (same degree, same prefill chunks: exact)."""
    import shutil
    import subprocess

    recipe = tmp_path / "tp2.yaml"
    recipe.write_text(
        f"model: {{path: {checkpoint(PRESETS[0])}, device: cpu, dtype: float32}}\n"
        f"parallel: {{tp: 2, timeout_s: {TIMEOUT_S}}}\nmtp: {{enabled: true, k: 2}}\n"
        f"cache: {{prefill_chunk: 16}}\nrun: {{prompts: {json.dumps(prompts())}, max_new_tokens: {MAX_NEW}, "
        "ignore_eos: true}\n"
    )
    exe = shutil.which("qwen-mtp")
    assert exe, "the qwen-mtp console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, "run", str(recipe)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tensor parallel over 2 ranks") == 1  # rank 1 prints nothing
    printed = [json.loads(line.split(": ", 1)[1]) for line in proc.stdout.splitlines() if "token ids:" in line]
    assert printed == rank_results(tp2)[0][PRESETS[0]]["off"]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_alone_stops_its_ranks(checkpoint, tmp_path, signame):
    """A SIGTERM to `qwen-mtp run` alone while its two ranks generate goes on to rank 0, a SIGINT (`kill -INT`, not
    a terminal's Ctrl-C, which reaches the ranks itself) to both; the launcher exits with an error, leaving no
    rank running (before, the ranks outlived a terminated launcher, and ran on after a SIGINT to it)."""
    import shutil
    import signal
    import subprocess

    recipe = tmp_path / "long.yaml"
    recipe.write_text(
        f"model: {{path: {checkpoint(PRESETS[0])}, device: cpu, dtype: float32}}\n"
        f"parallel: {{tp: 2, timeout_s: {TIMEOUT_S}}}\nrun: {{prompts: [[1, 2, 3]], max_new_tokens: 3000, "
        "ignore_eos: true}\n"
    )
    proc = subprocess.Popen(
        [shutil.which("qwen-mtp"), "run", str(recipe), "--progress-every", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,  # no controlling tty
    )  # fmt: skip
    try:
        while "generated" not in (line := proc.stderr.readline()):  # a progress line: the ranks are generating
            assert line, f"qwen-mtp run ended before generating: {proc.stderr.read()}"
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ranks = [int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(ranks) == 2, children
        proc.send_signal(getattr(signal, signame))
        assert proc.wait(60) != 0
        wait_gone(ranks)  # no rank outlives its launcher
        stderr = proc.stderr.read()
        assert ("rank 0 of 2 exited" if signame == "SIGTERM" else "KeyboardInterrupt") in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
