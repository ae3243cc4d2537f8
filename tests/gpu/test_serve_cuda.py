"""`qwen-mtp serve` on one GPU as a user starts it (the shipped model in bf16, CUDA graphs and the engine's GPU
defaults): concurrent requests answered with MTP K=3 equal the same server's answers with MTP off, and SIGTERM
stops it with status 0. The CPU tests (tests/test_serve.py) cover the API; this covers the engine loop driving
graphed, lookahead steps."""

from __future__ import annotations

from serve_helpers import gpu_answers_with_and_without_mtp

TEXTS = ["import os\n\ndef ", "class Stack:\n    def push(self, item):\n", "for i in range(10):\n", "def main():\n"]


def test_server_with_mtp_answers_as_without_on_the_gpu(tmp_path):
    prompts = [text * (1 + i % 3) for i, text in enumerate(TEXTS * 6)]  # 24 requests, three prompt lengths
    answers = gpu_answers_with_and_without_mtp(tmp_path, prompts, 48)
    assert answers[True] == answers[False]
    assert len(set(answers[False])) > 1  # the prompts lead somewhere different
