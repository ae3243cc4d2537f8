"""lm-eval end to end on CPU with local tasks (a task YAML + jsonl written here; no download): the `qwen-mtp`
model in-process through lm-eval's command line, and the same numbers through the server with
`local-completions`. Expected values come from the engine's own greedy output and from Hugging Face."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import load_hf
from serve_helpers import LiveServer, tiny_recipe

from qwen_mtp.engine import Engine, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}
GEN_PROMPTS = ["Hello world! How are", "The quick brown", "Once upon a time"]
MC_DOCS = [
    ("The quick brown fox jumps over the", ["lazy dog", "red car", "blue sky"]),
    ("Hello world! How are", ["you today?", "the cats", "three four"]),
    ("Greedy decoding picks the most", ["likely token", "unlikely cat", "green frog"]),
]


@pytest.fixture(scope="module")
def recipe_file(checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("lm-eval") / "recipe.yaml"
    path.write_text(f"model:\n  path: {checkpoint()}\n  dtype: float32\n  device: cpu\n")
    return path


@pytest.fixture(scope="module")
def engine(recipe_file):
    return Engine.from_recipe(recipe_file, log=lambda line: None)


def write_gen_task(folder: Path, engine: Engine) -> list[str]:
    """A generate_until task whose first two targets are the engine's greedy output and whose last is not:
    exact_match must be 2/3. Returns the greedy outputs."""
    outputs = [
        engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        for r in engine.generate([engine.encode(p) for p in GEN_PROMPTS], SamplingParams(8))
    ]
    targets = [*outputs[:2], outputs[2] + " (not what it says)"]
    rows = [{"prompt": p, "target": t} for p, t in zip(GEN_PROMPTS, targets, strict=True)]
    (folder / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "qmtp_gen.yaml").write_text(
        "task: qmtp_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'gen.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: prompt\ndoc_to_target: target\n"
        "generation_kwargs:\n  until: []\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return outputs


def write_mc_task(folder: Path, golds: list[int]) -> None:
    rows = [{"context": c, "choices": ch, "gold": g} for (c, ch), g in zip(MC_DOCS, golds, strict=True)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "qmtp_mc.yaml").write_text(
        "task: qmtp_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n"
    )


def lm_eval(*args: str, tasks: str, folder: Path) -> dict:
    out = folder / f"out-{len(list(folder.glob('out-*')))}"
    command = [
        sys.executable,
        "-m",
        "qwen_mtp.eval",
        *args,
        "--tasks",
        tasks,
        "--include_path",
        str(folder),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = out.glob("*/results_*.json")
    return json.loads(results.read_text())["results"]


def test_lm_eval_cli_generate_until_scores_the_engine_output(recipe_file, engine, tmp_path):
    write_gen_task(tmp_path, engine)
    results = lm_eval("--model", "qwen-mtp", "--model_args", f"recipe={recipe_file}", tasks="qmtp_gen", folder=tmp_path)
    assert results["qmtp_gen"]["exact_match,none"] == pytest.approx(2 / 3)


def hf_continuation_logprob(model, tokenizer_encode, context: str, continuation: str) -> float:
    """lm-eval's scoring of one choice by Hugging Face (fp32): the continuation split off the whole encoding."""
    context_ids = tokenizer_encode(context)
    whole = tokenizer_encode(context + continuation)
    ids = torch.tensor([whole])
    with torch.inference_mode():
        logprobs = model(ids).logits.float().log_softmax(-1)[0]
    return sum(logprobs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


def test_lm_eval_loglikelihood_and_generation_in_process_and_through_the_server(
    recipe_file, engine, checkpoint, tmp_path
):
    hf = load_hf(checkpoint(), torch.float32)
    best = [
        max(range(3), key=lambda j: hf_continuation_logprob(hf, engine.encode, context, " " + choices[j]))
        for context, choices in MC_DOCS
    ]
    golds = [best[0], best[1], (best[2] + 1) % 3]  # acc must be 2/3
    write_mc_task(tmp_path, golds)
    write_gen_task(tmp_path, engine)
    local = lm_eval(
        "--model", "qwen-mtp", "--model_args", f"recipe={recipe_file}", tasks="qmtp_mc,qmtp_gen", folder=tmp_path
    )
    assert local["qmtp_mc"]["acc,none"] == pytest.approx(2 / 3)
    assert local["qmtp_gen"]["exact_match,none"] == pytest.approx(2 / 3)
    with LiveServer.from_recipe(tiny_recipe(checkpoint())) as live:
        args = f"base_url={live.url}/completions,model=qwen-mtp,tokenizer={checkpoint()},tokenized_requests=True"
        served = lm_eval(
            "--model", "local-completions", "--model_args", args, tasks="qmtp_mc,qmtp_gen", folder=tmp_path
        )
    assert served["qmtp_mc"]["acc,none"] == local["qmtp_mc"]["acc,none"]
    assert served["qmtp_gen"]["exact_match,none"] == local["qmtp_gen"]["exact_match,none"]


def test_generate_until_honours_repetition_penalty_and_refuses_what_it_cannot(recipe_file, engine):
    """A task's `repetition_penalty` (Hugging Face's generation argument) reaches the engine; an argument the engine
    cannot honour is an error, not silently dropped."""
    from qwen_mtp.eval.lm import QwenMTPLM

    lm = QwenMTPLM(recipe=str(recipe_file), max_gen_toks=12)
    context = GEN_PROMPTS[2]
    [text] = lm.generate_until([SimpleNamespace(args=(context, {"until": [], "repetition_penalty": 1.5}))])
    params = SamplingParams(12, repetition_penalty=1.5)
    (result,) = engine.generate([engine.encode(context)], params)
    assert text == engine.decode(result.token_ids)
    (unpenalized,) = engine.generate([engine.encode(context)], SamplingParams(12))
    assert unpenalized.token_ids != result.token_ids
    with pytest.raises(Exception, match="cannot honour.*length_penalty"):
        lm.generate_until([SimpleNamespace(args=(context, {"until": [], "length_penalty": 2.0}))])


def test_tensor_parallel_recipes_are_sent_to_the_server(recipe_file):
    """The in-process model runs one engine in one process: a tensor-parallel recipe is refused before anything
    loads, naming the route that works (the server, which runs under TP, and lm-eval's local-completions)."""
    from qwen_mtp.errors import RecipeError
    from qwen_mtp.eval.lm import QwenMTPLM

    with pytest.raises(RecipeError, match=r"parallel.tp=2: .*qwen-mtp serve.*local-completions"):
        QwenMTPLM(recipe=str(recipe_file), **{"parallel.tp": 2})


def test_loglikelihood_rolling_equals_hf(recipe_file, checkpoint):
    import qwen_mtp.eval.lm as adapter

    lm = adapter.QwenMTPLM(recipe=str(recipe_file))
    text = "Speculative decoding drafts a few tokens and verifies them in one forward pass."
    (score,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    hf = load_hf(checkpoint(), torch.float32)
    # the string conditioned on the prefix token (EOS), as lm-eval scores it
    want = hf_continuation_logprob(hf, lambda s: [lm.eot_token_id] + lm.tok_encode(s), "", text)
    assert score == pytest.approx(want, rel=1e-4)
