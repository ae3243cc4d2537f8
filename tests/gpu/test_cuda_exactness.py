"""On CUDA (Triton kernels on the decode/verify/draft path): logits vs Hugging Face, MTP-on == MTP-off for
K = 1..4 at batch 1, 8 and 32 in bf16 (eager, CUDA graphs, and torch.compile + graphs), and a stress run with
a changing batch mix under CUDA graphs."""

import importlib.util
import random

import pytest
import torch
from helpers import RandomK, chained_launches, load_hf, random_prompt

from qwen_mtp import Engine, SamplingParams, load_model
from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import reference_ops

MODES = {  # eager kernels, CUDA graphs of them (the default on CUDA), or torch.compile (inductor) + CUDA graphs +
    # compiled prefill
    "eager": {"cuda_graphs": False},
    "graphs": {"cuda_graphs": True},
    "compiled": {"cuda_graphs": True, "enabled": True, "prefill": True},
}


def engine_for(model_source, k=None, draft="head", accept=1.0, max_batch=32, mode="eager", **cache):
    # explicit page counts: several engines live at once here, each must not claim most of the GPU
    cache = {"max_batch": max_batch, "num_state_rows": max_batch, "num_pages": 40 * max_batch, **cache}
    recipe = {"model": {**model_source, "dtype": "bfloat16", "device": "cuda"}, "cache": cache}
    recipe["compile"] = MODES[mode]
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, "draft": draft, "oracle_accept": accept}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("preset,layout", [("tiny", "text"), ("tiny-tied", "vlm"), ("tiny-8l", "text")])
def test_logits_match_hf_on_cuda(checkpoint, preset, layout):
    """Every op but the prefill kernels rounds like Hugging Face's torch code: logits within 2 bf16 ulps almost
    everywhere. The GDN prefill kernels compute the delta rule in another (chunk-local) order, so here they
    step aside for the torch form (their accuracy: the next test); the other ops' kernels run. (The paged
    prefill attention kernel is not on this cache-less path; its accuracy: tests/ops/test_prefill_attention.py.)"""
    path = checkpoint(preset, layout, dtype="bfloat16")
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.inference_mode(), reference_ops("gdn_chunked"):
        ours = load_model(path, dtype=torch.bfloat16, device="cuda")(ids).float()
        ref = load_hf(path, torch.bfloat16).cuda()(ids).logits.float()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp(min=2**-10)
    # transformers runs flash-linear-attention's chunked kernel in place of its torch delta rule wherever `fla`
    # imports (the device's carried wheels include it): then the reference itself sums in another order
    fla = importlib.util.find_spec("fla") is not None
    assert ((ours - ref).abs() <= 2 * ulp).float().mean() > 0.999, "fla importable: HF ran its kernel" if fla else ""


@pytest.mark.parametrize("preset,layout", [("tiny", "text"), ("tiny-8l", "text")])
def test_prefill_kernels_as_accurate_as_hf(checkpoint, preset, layout):
    """With the Triton GDN prefill, bf16 logits are as close to an fp32 run of Hugging Face's model as
    Hugging Face's own bf16 logits are, and pick the same greedy tokens as often."""
    path = checkpoint(preset, layout, dtype="bfloat16")
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(2)).cuda()  # 5 chunks
    with torch.inference_mode():
        ours = load_model(path, dtype=torch.bfloat16, device="cuda")(ids).float()
        hf = load_hf(path, torch.bfloat16).cuda()(ids).logits.float()
        truth = load_hf(path, torch.float32).cuda()(ids).logits
    ours_err, hf_err = (ours - truth).abs().mean(), (hf - truth).abs().mean()
    assert ours_err <= 1.2 * hf_err, (ours_err, hf_err)
    best = truth.argmax(-1)
    ours_agree, hf_agree = ((x.argmax(-1) == best).float().mean() for x in (ours, hf))
    assert ours_agree >= hf_agree - 0.01, (ours_agree, hf_agree)


@pytest.mark.parametrize(
    "k,mode,batches",
    [(k, mode, (1, 8, 32)) for mode in ("eager", "graphs") for k in (1, 2, 3, 4)],
)
def test_mtp_equals_plain_bf16_batch_1_8_32(k, mode, batches):
    source = {"synthetic": "qwen3.5-0.8b"}
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (1, k + 1, 7, 130, 64, 300, 2, 33) * 4]
    plain = engine_for(source, mode=mode)
    spec = engine_for(source, k=k, draft="oracle", accept=0.7, mode=mode)
    for batch in batches:
        expected = [r.token_ids for r in plain.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        got = [r.token_ids for r in spec.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        diverged = [
            (i, next(j for j, (a, b) in enumerate(zip(g, e, strict=True)) if a != b))
            for i, (g, e) in enumerate(zip(got, expected, strict=True))
            if g != e
        ]
        assert not diverged, f"K={k} batch={batch}: (request, first differing token) {diverged}"
    head = engine_for(source, k=k, mode=mode)
    assert [r.token_ids for r in head.generate(prompts[:8], max_new_tokens=24, ignore_eos=True)] == expected[:8]
    if mode == "graphs":  # graphs change how a step is launched, never its numbers
        eager = engine_for(source)
        assert [r.token_ids for r in eager.generate(prompts[:8], max_new_tokens=24, ignore_eos=True)] == expected[:8]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_equals_plain_long_context_graphs(k):
    """Prompts of 1 to 32k tokens: split-KV attention over up to 64 chunks of 512 keys, contexts ending on,
    just past and just short of a chunk boundary, verify rows straddling one. MTP-on == MTP-off at batch 1 and 8,
    with CUDA graphs (the engine's default)."""
    source = {"synthetic": "qwen3.5-0.8b"}
    lengths = (32768, 1, 511, 512 - k, 8192, 1024 + k, 20000, 4097)
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in lengths]
    cache = {"num_pages": 8 * (32768 // 64 + 8), "prefill_chunk": 2048}
    plain = engine_for(source, max_batch=8, mode="graphs", **cache)
    spec = engine_for(source, k=k, draft="oracle", accept=0.7, max_batch=8, mode="graphs", **cache)
    for batch in (1, 8):
        expected = [r.token_ids for r in plain.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        got = [r.token_ids for r in spec.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        assert got == expected, f"K={k} batch={batch}"


def test_compiled_mtp_equals_plain_tiny():
    """torch.compile (inductor, fullgraph) + CUDA graphs on an 8-layer fixture, which compiles in seconds where
    the 0.8B model's steps take minutes: MTP-on == MTP-off at batch 1 and 4. (Not compared with the uncompiled
    engine: inductor fuses the elementwise glue without rounding between ops, so it may round differently.)"""
    source = {"fixture": "tiny-8l"}
    prompts = [random_prompt(n, seed=n) for n in (1, 3, 40, 9)]
    plain = engine_for(source, max_batch=4, mode="compiled")
    spec = engine_for(source, k=2, draft="oracle", accept=0.7, max_batch=4, mode="compiled")
    for batch in (1, 4):
        expected = [r.token_ids for r in plain.generate(prompts[:batch], max_new_tokens=16, ignore_eos=True)]
        got = [r.token_ids for r in spec.generate(prompts[:batch], max_new_tokens=16, ignore_eos=True)]
        assert got == expected, f"batch {batch}"


@pytest.mark.parametrize("k", [None, 3])
def test_programmatic_dependent_launch_changes_no_bit(monkeypatch, k):
    """Kernels that start early under programmatic dependent launch (`triton_utils.launch`) wait for the one
    before them, so the tokens and their log-probabilities are the same bits with it (the default) and without,
    plain and with MTP, at batch 8 under CUDA graphs."""
    source = {"synthetic": "qwen3.5-0.8b"}
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (1, 5, 7, 130, 64, 300, 2, 33)]
    params = SamplingParams(24, ignore_eos=True, logprobs=2)

    def run():
        engine = engine_for(source, k=k, draft="oracle", accept=0.7, max_batch=8, mode="graphs")
        results = engine.generate(prompts, params)
        return [(r.token_ids, [(e.logprob, e.top) for e in r.logprobs]) for r in results]

    with_pdl = run()
    monkeypatch.setattr(triton_utils, "PDL_ENABLED", False)
    assert run() == with_pdl


@pytest.mark.parametrize("k,mode,lookahead", [(2, "graphs", False), (4, "graphs", False), (3, "graphs", True)])
def test_stress_changing_batch_mix(k, mode, lookahead):
    """200 prompts (lengths 1..2048), 256 new tokens, arriving while others run: each request's tokens equal
    its plain-decode tokens (also with `cache.lookahead`, each step launched before the last one is read)."""
    rng = random.Random(k)
    prompts = [random_prompt(rng.randint(1, 2048), seed=i, vocab=200000) for i in range(200)]
    source = {"synthetic": "qwen3.5-0.8b"}
    plain = engine_for(source, max_batch=64, prefill_chunk=512, mode=mode)
    expected = [r.token_ids for r in plain.generate(prompts, max_new_tokens=256, ignore_eos=True)]
    del plain
    torch.cuda.empty_cache()
    spec = engine_for(
        source, k=k, draft="oracle", accept=0.7, max_batch=64, prefill_chunk=512, mode=mode, lookahead=lookahead
    )
    ids = []
    for i, prompt in enumerate(prompts):  # staggered arrivals: the batch mix changes every few steps
        ids.append(spec.submit_with_oracle(prompt, expected[i], SamplingParams(256, ignore_eos=True)))
        if i % 3 == 0:
            spec.step()
    while spec.has_unfinished():
        spec.step()
    assert [spec.result(i).token_ids for i in ids] == expected
    stats = spec.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["acceptance_length"] > 1.5


@pytest.mark.parametrize("k", [None, 2, 4], ids=["plain", "k2", "k4"])
def test_lookahead_equals_plain_graphs(k):
    """`cache.lookahead` under CUDA graphs: each step launched before the previous one's results are read (its
    inputs from that step's device outputs) gives plain decoding's tokens at batch 1, 8 and 32, and chains ran."""
    source = {"synthetic": "qwen3.5-0.8b"}
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (1, 5, 7, 130, 64, 300, 2, 33) * 4]
    plain = engine_for(source, mode="graphs")
    ahead = engine_for(source, k=k, draft="oracle", accept=0.7, mode="graphs", lookahead=True)
    for batch in (1, 8, 32):
        expected = plain.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)
        if k is None:
            got = ahead.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)
        else:
            params = SamplingParams(24, ignore_eos=True)
            ids = [
                ahead.submit_with_oracle(p, e.token_ids, params) for p, e in zip(prompts[:batch], expected, strict=True)
            ]
            while ahead.has_unfinished():
                ahead.step()
            got = [ahead.result(i) for i in ids]
        assert [r.token_ids for r in got] == [r.token_ids for r in expected], f"batch {batch}"
    assert ahead.lookahead_steps > 0


def test_k_auto_chained_steps_equal_plain_graphs():
    """`mtp.k: auto` under CUDA graphs with the lookahead, K changing at random (0..4, sticky, so steps chain at
    each K and K = 0 positions are caught up for several requests in one packed pass when K rises): plain
    decoding's tokens at batch 1, 8 and 32."""
    source = {"synthetic": "qwen3.5-0.8b"}
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (1, 5, 7, 130, 64, 300, 2, 33) * 4]
    plain = engine_for(source, mode="graphs")
    auto = engine_for(source, k="auto", draft="oracle", accept=0.7, mode="graphs", lookahead=True)
    auto.speculator.policy = RandomK(3, max_k=auto.speculator.max_k)
    chained, packed, spans = chained_launches(auto), [], auto.runner.prefill_mtp_spans
    auto.runner.prefill_mtp_spans = lambda s: packed.append(len(s)) or spans(s)
    for batch in (1, 8, 32):
        expected = plain.generate(prompts[:batch], max_new_tokens=40, ignore_eos=True)
        params = SamplingParams(40, ignore_eos=True)
        ids = [auto.submit_with_oracle(p, e.token_ids, params) for p, e in zip(prompts[:batch], expected, strict=True)]
        while auto.has_unfinished():
            auto.step()
        got = [auto.result(i).token_ids for i in ids]
        assert got == [r.token_ids for r in expected], f"batch {batch}"
    ks = {k for k, _ in chained}
    assert len(ks) >= 3 and 0 in ks and max(packed) > 1, (chained, packed)
