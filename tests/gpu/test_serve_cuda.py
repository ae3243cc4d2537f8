"""`qwen-mtp serve` on one GPU as a user starts it (the shipped model in bf16, CUDA graphs and the engine's GPU
defaults): concurrent requests answered with MTP K=3 equal the same server's answers with MTP off, and SIGTERM
stops it with status 0. The CPU tests (tests/test_serve.py) cover the API; this covers the engine loop driving
graphed, lookahead steps."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from serve_helpers import CliServer, greedy_answers

SMALL = Path(__file__).resolve().parents[2] / "models" / "qwen-mtp-small"
TEXTS = ["import os\n\ndef ", "class Stack:\n    def push(self, item):\n", "for i in range(10):\n", "def main():\n"]


def test_server_with_mtp_answers_as_without_on_the_gpu(tmp_path):
    prompts = [text * (1 + i % 3) for i, text in enumerate(TEXTS * 6)]  # 24 requests, three prompt lengths
    answers = {}
    for mtp in (False, True):
        recipe = tmp_path / f"serve-mtp-{mtp}.yaml"
        recipe.write_text(
            f"model:\n  path: {SMALL}\n  dtype: bfloat16\n  device: cuda\n"
            f"mtp:\n  enabled: {str(mtp).lower()}\n  k: 3\n"
            "compile:\n  cuda_graphs: true\n"
        )
        server = CliServer(recipe, start_s=300)
        try:
            answers[mtp] = asyncio.run(greedy_answers(server.url, prompts, 48))
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(120) == 0, server.stderr()
        finally:
            server.close()
    assert answers[True] == answers[False]
    assert len(set(answers[False])) > 1  # the prompts lead somewhere different
