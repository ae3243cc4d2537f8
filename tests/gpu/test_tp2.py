"""Tensor parallel on two GPUs (NCCL): MTP-on == MTP-off at TP=2 with the collectives inside CUDA graphs (and
torch.compile), at real 27B shapes with random weights and on the bf16 tiny fixture; and on the shipped model the
features that run under TP (sampling, penalties and logprobs on gathered rows, draft heads, k: auto, prefix
caching), and `qwen-mtp serve` at TP=2. Needs 2 GPUs (the nvidia-h200-x2 machine); skipped on one. The CPU
proofs (gloo) are tests/test_parallel.py and tests/test_serve_parallel.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import tp2_workers
from serve_helpers import gpu_answers_with_and_without_mtp

from qwen_mtp.parallel.launch import spawn_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel needs 2 GPUs")

MODES = {"graphs": {"cuda_graphs": True}, "compiled": {"cuda_graphs": True, "enabled": True}}


def run_ranks(worker, spec: dict, out: Path) -> list[dict]:
    """Spawn two NCCL ranks running `worker` on `spec` (written to out/spec.json); each rank's rank<r>.json."""
    (out / "spec.json").write_text(json.dumps(spec))
    ranks = spawn_ranks(2, "nccl", 600.0, worker, (str(out / "spec.json"),))
    deadline = time.monotonic() + 1200
    try:
        while not ranks.join(timeout=5):
            assert time.monotonic() < deadline, "the TP=2 ranks did not finish in 20 minutes"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# 27B shapes with CUDA graphs; the bf16 fixtures (a replicated KV head; MoE) with graphs, and with torch.compile
# (inductor on 27B takes minutes per graph). benchmarks/gpu_suite.sh's `-k "not compiled"` leaves the compiled case out.
@pytest.mark.parametrize(
    "model,mode",
    [("synthetic-27b", "graphs"), ("tiny-8l", "graphs"), ("tiny-8l", "compiled"), ("tiny-moe", "graphs")],
)
def test_tp2_mtp_gives_the_plain_tokens_on_two_gpus(checkpoint, tmp_path, model, mode):
    if model.startswith("synthetic"):
        source = {"synthetic": "qwen3.5-27b"}
    else:
        source = {"path": str(checkpoint(model, dtype="bfloat16"))}
    gen = torch.Generator().manual_seed(3)
    vocab = 248320 if model.startswith("synthetic") else 512
    spec = {
        "out": str(tmp_path),
        "recipe": {
            "model": {**source, "dtype": "bfloat16", "device": "cuda"},
            "parallel": {"tp": 2, "timeout_s": 600},
            "compile": MODES[mode],
        },
        "prompts": [
            torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in (17, 130, 5, 64, 9, 300, 33, 2)
        ],
        "max_new_tokens": 48,
    }
    first, second = run_ranks(tp2_workers.tp2_exactness, spec, tmp_path)
    assert first == second  # every rank emits the same tokens
    for batch in (1, 8):
        plain = first[f"b{batch}-k0"]
        for k in (1, 2, 3):
            assert first[f"b{batch}-k{k}"] == plain, f"batch {batch}, K={k}: MTP tokens != plain at TP=2"
    assert first["b8-k0"][:1] == first["b1-k0"]  # a request's tokens do not depend on its batch


SMALL = Path(__file__).resolve().parents[2] / "models" / "qwen-mtp-small"
TEXTS = ["import os\n\ndef ", "class Stack:\n    def push(self, item):\n", "for i in range(10):\n", "def main():\n"]


def test_tp2_sampling_draft_heads_k_auto_and_prefix_caching_on_two_gpus(tmp_path):
    """The shipped model at TP=2, bf16, CUDA graphs: sampled, penalized and greedy requests with logprobs give
    MTP-off's tokens, logprobs and top ids under MTP K=2, with a draft vocabulary, with the FP8 draft lm_head and
    with k: auto; a conversation with prefix caching gives the cold run's tokens; both ranks agree."""
    spec = {
        "out": str(tmp_path),
        "recipe": {
            "model": {"path": str(SMALL), "dtype": "bfloat16", "device": "cuda"},
            "parallel": {"tp": 2, "timeout_s": 600},
            "compile": {"cuda_graphs": True},
        },
        "texts": TEXTS,
        "max_new_tokens": 32,
    }
    first, second = run_ranks(tp2_workers.tp2_features, spec, tmp_path)
    assert first == second
    for name in tp2_workers.FEATURE_RUNS:
        assert first[name] == first["off"], name
    assert first["prefix_cached"] == first["prefix_cold"] and first["prefix_hits"] > 0


def test_tp2_server_with_mtp_answers_as_without_on_two_gpus(tmp_path):
    """`qwen-mtp serve` at TP=2 (NCCL, graphs, the shipped model in bf16): concurrent requests answered with MTP
    K=3 equal the answers of the same server with MTP off; SIGTERM stops both ranks with status 0."""
    answers = gpu_answers_with_and_without_mtp(tmp_path, TEXTS * 4, 48, tp=2)
    assert answers[True] == answers[False]
