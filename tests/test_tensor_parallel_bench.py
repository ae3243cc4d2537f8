"""`benchmarks/tensor_parallel.py` (issue #23's figures on two GPUs) on this machine: two gloo ranks on the tiny
checkpoint decode MTP off and on at two batch sizes and agree with each other and with TP=1; the collectives are
counted on the model and timed; where TP=N leaves TP=1 is located; a step's collectives are costed as documented."""

import json
import sys
from pathlib import Path

import pytest
from helpers import benchmark_module

from qwen_mtp.model import Linear, QwenHybridForCausalLM
from qwen_mtp.parallel.launch import recipe_model_config
from qwen_mtp.recipe import load_recipe

TINY = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml")
CPU = ["--set", "model.device=cpu", "--set", "model.dtype=float32", "--set", "parallel.timeout_s=60"]


def run(monkeypatch, *argv: str) -> int:
    module = benchmark_module("tensor_parallel")
    monkeypatch.setattr(sys, "argv", ["tensor_parallel.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    return exit_.value.code


def test_two_ranks_give_mtp_off_tokens_at_every_k_and_batch_and_tp1_tokens(tmp_path, monkeypatch):
    argv = ["tokens", TINY, "--out", str(tmp_path), "--prompts", "4", "--batches", "1", "3",
            "--ks", "1", "2", "--new-tokens", "6", *CPU]  # fmt: skip
    assert run(monkeypatch, *argv) == 0
    report = json.loads((tmp_path / "tp-tokens.json").read_text())
    assert report["ranks_agree"]
    assert report["mtp_equals_plain"] == {f"b{b}-k{k}": True for k in (0, 1, 2) for b in (1, 3)}
    assert report["batch_equals_alone"] == {"1": True, "3": True}
    assert report["prompt_lengths"] == [5, 17, 64, 130]  # short, chunk-crossing and long prompts mixed
    # fp32: TP=2 keeps TP=1's tokens here, up to a near-tie (two partial sums round unlike one sum)
    assert report["tp1_vs_tpn"]["requests"] == 4
    assert all(case["tp1_lead"] is not None and case["tp1_lead"] < 1e-3 for case in report["tp1_vs_tpn"]["parted"])


def test_collectives_are_counted_on_the_model_and_timed_at_each_row_count(tmp_path, monkeypatch):
    assert run(monkeypatch, "collectives", TINY, "--out", str(tmp_path), "--rows", "1", "3",
               "--calls", "5", *CPU) == 0  # fmt: skip
    report = json.loads((tmp_path / "tp-collectives.json").read_text())
    config = recipe_model_config(load_recipe(TINY))
    model = QwenHybridForCausalLM(config)
    linears = [name for name, module in model.named_modules() if isinstance(module, Linear)]
    partial = [name for name in linears if name.endswith(("o_proj", "out_proj", "down_proj"))]
    assert report["per_forward"] == {  # one per row-parallel linear, and the embedding's
        "target": sum(not name.startswith("mtp.") for name in partial) + 1,
        "mtp": sum(name.startswith("mtp.") for name in partial) + 1,
    }
    assert report["per_forward"]["target"] == 2 * config.num_hidden_layers + 1
    assert set(report["rows"]) == {"1", "3"}
    assert all(t["all_reduce_us"] > 0 and t["all_gather_us"] > 0 for t in report["rows"].values())


def test_where_tp_tokens_part_from_tp1_and_by_how_much_tp1_led():
    module = benchmark_module("tensor_parallel")
    tp1 = [[5, 6, 7], [1, 2, 3], [4, 4, 4]]
    tpn = [[5, 6, 7], [1, 9, 3], [8, 4, 4]]
    top = [
        [{"5": -0.1}, {"6": -0.2}, {"7": -0.3}],
        [{"1": -0.5}, {"2": -0.69, "9": -0.70}, {"3": -1.0}],
        [{"4": -0.2, "3": -3.0}, {"4": -0.1}, {"4": -0.1}],  # TP=N's 8 is not among TP=1's top tokens
    ]
    parted = module.where_tokens_part(tp1, tpn, top)
    where = [(p["request"], p["position"], p["tp1_token"], p["tpn_token"]) for p in parted]
    assert where == [(1, 1, 2, 9), (2, 0, 4, 8)]
    assert parted[0]["tp1_lead"] == pytest.approx(0.01)
    assert parted[1]["tp1_lead"] is None


def test_a_step_costs_each_forward_its_all_reduces_and_one_all_gather():
    """Plain: one target forward over B rows. MTP K: the verify and the head's catch-up over B(K+1) rows, then K-1
    chained draft steps over B rows (docs/parallel.md)."""
    module = benchmark_module("tensor_parallel")
    collectives = {
        "per_forward": {"target": 129, "mtp": 3},
        "rows": {str(m): {"all_reduce_us": 10.0 + m, "all_gather_us": 1.0} for m in (1, 3, 8, 24)},
    }
    plain = module.step_collectives_us({"mode": "plain", "k": 0, "batch": 8}, collectives)
    assert plain == 129 * 18.0 + 1.0
    k2 = module.step_collectives_us({"mode": "mtp", "k": 2, "batch": 1}, collectives)
    assert k2 == (129 * 13.0 + 1.0) + (3 * 13.0 + 1.0) + (3 * 11.0 + 1.0)
    assert module.step_collectives_us({"mode": "mtp", "k": 3, "batch": 8}, collectives) is None  # 32 rows: unmeasured
