"""`qwen-mtp serve` with `parallel.tp: 2` on CPU (two gloo ranks, the CLI as a user starts it): rank 0 serves and
the other rank follows its engine loop (serve/relay.py). Answers equal TP=1 with MTP off; a cancelled and a
refused request leave the ranks in step; SIGTERM stops every rank gracefully; a rank that dies stops the server
with an error instead of leaving it hung."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from helpers import random_prompt, wait_gone
from serve_helpers import CliServer, tiny_recipe

from qwen_mtp.engine import Engine, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"model": "qwen-mtp", "temperature": 0}


def write_recipe(tmp_path: Path, checkpoint: Path) -> Path:
    recipe = tmp_path / "serve-tp2.yaml"
    recipe.write_text(
        f"model:\n  path: {checkpoint}\n  dtype: float32\n  device: cpu\n"
        "mtp:\n  enabled: true\n  k: 2\n"
        "cache:\n  prefill_chunk: 16\n"
        "parallel:\n  tp: 2\n  timeout_s: 30\n"
    )
    return recipe


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    """TP=1, MTP off, on this process: what every answer must equal."""
    return Engine.from_recipe(tiny_recipe(chat_checkpoint, "cache.prefill_chunk=16"), log=lambda line: None)


def expected(reference: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    ids = [reference.submit(prompt, params) for prompt, params in requests]
    while reference.has_unfinished():
        reference.step()
    return [reference.result(i).token_ids for i in ids]


def text(engine: Engine, token_ids: list[int]) -> str:
    return engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_tp2_server_answers_tp1_tokens_cancels_and_stops_gracefully(tmp_path, chat_checkpoint, reference):
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 9, 17, 40, 5, 26)]  # 40: three prefill chunks of 16
    lengths = [12, 5, 16, 9, 1, 14]
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    want = expected(reference, [(p, SamplingParams(n, ignore_eos=True)) for p, n in zip(prompts, lengths, strict=True)])
    (want_sampled,) = expected(
        reference, [(prompts[1], SamplingParams(10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11))]
    )
    server = CliServer(write_recipe(tmp_path, chat_checkpoint))
    try:
        ranks = server.ranks()

        async def answers():
            async with openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0) as c:
                greedy = [
                    c.completions.create(prompt=p, max_tokens=n, logprobs=1, extra_body={"ignore_eos": True}, **GREEDY)
                    for p, n in zip(prompts, lengths, strict=True)
                ]
                sample = c.completions.create(
                    prompt=prompts[1], max_tokens=10, extra_body={"ignore_eos": True}, model="qwen-mtp", **sampled
                )
                return await asyncio.gather(*greedy, sample)

        *outs, out_sampled = asyncio.run(answers())  # all at once: the ranks batch them alike
        assert [o.choices[0].text for o in outs] == [text(reference, w) for w in want]
        assert [len(o.choices[0].logprobs.tokens) for o in outs] == lengths
        assert out_sampled.choices[0].text == text(reference, want_sampled)

        # a client that goes away mid-stream, and a refused request: both ranks must stay in step
        body = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True, **GREEDY}
        with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as response:
            assert next(response.iter_lines()).startswith("data: ")
        bad = httpx.post(server.url + "/completions", json={"prompt": [10**9], "max_tokens": 1, **GREEDY})
        assert bad.status_code == 400 and "outside the vocabulary" in bad.text
        again = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0).completions.create(
            prompt=prompts[2], max_tokens=lengths[2], extra_body={"ignore_eos": True}, **GREEDY
        )
        assert again.choices[0].text == text(reference, want[2])

        # SIGTERM to `qwen-mtp serve` mid-stream: the running request finishes, then every rank exits, status 0
        body = {"prompt": [1, 2, 3], "max_tokens": 60, "ignore_eos": True, "stream": True, **GREEDY}
        with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0, server.stderr()
        wait_gone(ranks.values())
        assert "server stopped" in server.stderr()
    finally:
        server.close()


def test_a_rank_that_dies_stops_the_tp2_server_with_an_error(tmp_path, chat_checkpoint):
    server = CliServer(write_recipe(tmp_path, chat_checkpoint))
    try:
        ranks = server.ranks()
        os.kill(ranks[1], signal.SIGKILL)
        assert server.proc.wait(90) != 0
        wait_gone(ranks.values())
        stderr = server.stderr()
        assert "rank 1 of 2 exited" in stderr or "engine loop stopped" in stderr, stderr
    finally:
        server.close()


def test_relay_latency_benchmark_sends_every_case_intact(tmp_path):
    """benchmarks/relay_latency.py: rank 1 receives each message equal to what rank 0 sent (it asserts so), and the
    report has a time for each case."""
    out = tmp_path / "relay.json"
    command = [sys.executable, "benchmarks/relay_latency.py", "--messages", "20", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["case"] for row in rows] == ["empty pass (a step, nothing new)", "a new request, 2048-token prompt",
                                             "a cancellation"]  # fmt: skip
    assert all(row["us_per_message"] > 0 for row in rows)
