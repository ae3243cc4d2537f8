"""Structured outputs on CUDA: the token mask at the real vocabulary (248,320 tokens) equals llguidance's own
application, bf16 and fp32; constrained MTP-on == MTP-off for K = 1..4 at batch 1, 8 and 32 under CUDA graphs
(constrained greedy, sampled and penalized requests beside free ones, tokens and logprobs); a step with a constrained
request is never launched ahead, and costs one synchronisation (its read-back)."""

import llguidance.torch
import pytest
import torch
from helpers import random_prompt
from test_cuda_exactness import engine_for
from test_host_syncs import synchronisations
from test_sampling_cuda import check_batches_1_8_32

from qwen_mtp import SamplingParams, StructuredOutput
from qwen_mtp.engine.grammar import apply_token_mask, mask_words

VOCAB = 248_320
SOURCE = {"fixture": "tiny-8l"}  # a checkpoint with a tokenizer (the synthetic presets have none)
KINDS = [
    {"structured": StructuredOutput(regex=r"[0-9]{2,6}-[a-z]+")},
    {},
    {"structured": StructuredOutput(json_schema={"type": "array", "items": {"type": "integer"}})},
    {"structured": StructuredOutput(regex=r"[a-z ]+"), "temperature": 0.9, "top_p": 0.9},
    {"temperature": 0.8, "ignore_eos": True},
    {"structured": StructuredOutput(choice=["yes", "no", "not sure"]), "logprobs": 2},
    {"structured": StructuredOutput(json_object=True), "repetition_penalty": 1.2},
    {"structured": StructuredOutput(grammar='start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'), "temperature": 1.0},
]


def params(i: int, max_new: int) -> SamplingParams:
    return SamplingParams(max_new, seed=500 + i, **KINDS[i % len(KINDS)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_mask_equals_llguidance_at_real_vocab(dtype):
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(160, VOCAB, generator=generator) * 4).to(dtype).cuda()
    allowed = torch.randint(-(2**31), 2**31 - 1, (160, mask_words(VOCAB)), generator=generator, dtype=torch.int64)
    allowed = allowed.to(torch.int32).cuda()
    allowed[0], allowed[1] = -1, 0
    expected = logits.clone()
    llguidance.torch.apply_token_bitmask_inplace(expected, allowed)
    assert torch.equal(apply_token_mask(logits, allowed), expected)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_constrained_mtp_equals_plain_batch_1_8_32_graphs(k):
    prompts = [random_prompt(n, seed=n) for n in (1, k + 1, 7, 130, 64, 300, 2, 33) * 4]
    plain = engine_for(SOURCE, mode="graphs")
    spec = engine_for(SOURCE, k=k, draft="oracle", accept=0.7, mode="graphs")
    head = engine_for(SOURCE, k=k, mode="graphs")
    check_batches_1_8_32(plain, spec, head, prompts, len(KINDS), params)
    assert spec.stats()["acceptance_length"] > 1.3


def test_constrained_steps_are_not_launched_ahead_and_read_once():
    engine = engine_for(SOURCE, k=2, max_batch=4, mode="graphs")
    prompts = [random_prompt(n, seed=n) for n in (3, 40, 9, 17)]
    free = SamplingParams(64, ignore_eos=True)
    constrained = SamplingParams(64, ignore_eos=True, structured=StructuredOutput(regex="[a-z]{60,}"))
    ids = [engine.submit(p, constrained if i == 1 else free) for i, p in enumerate(prompts)]
    while any(engine.requests[i].in_prefill or engine.requests[i].num_output < 2 for i in ids):
        engine.step()
    before = engine.lookahead_steps
    syncs, reads = synchronisations(engine, 8)
    assert not any(engine.requests[i].done for i in ids)
    assert engine.lookahead_steps == before and reads == 8 and len(syncs) <= 8, syncs
