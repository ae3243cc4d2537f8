"""`mtp.draft_lm_head: fp8`: the draft steps score an FP8 128x128-block copy of the lm_head (or of a draft
vocabulary's rows) while the target verifies with the lm_head as loaded, so MTP-on == MTP-off greedy and sampled;
the drafts are the argmax (or the coupled Gumbel argmax) of the dequantized copy's logits, within FP8 tolerance
of the unquantized ones, over real ids only when N is not a multiple of 128; a bad value is a RecipeError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import cpu_engine, generate_all, random_prompt

from qwen_mtp import Engine, RecipeError, SamplingParams
from qwen_mtp.engine.sampling import Mode
from qwen_mtp.model.mtp import DraftLmHead
from qwen_mtp.ops.sampling import gumbel_noise
from qwen_mtp.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from qwen_mtp.train.evaluate import measure_acceptance, read_prompts

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "qwen-mtp-small"  # the trained model (docs/training.md)
FIGURES = SMALL / "acceptance_draft_vocab.json"  # its bf16 acceptance with and without a draft vocabulary
MAX_NEW = 12
PROMPTS = [random_prompt(n, seed=700 + n) for n in (1, 4, 5, 33, 2, 19)]
DRAFT_VOCAB = 200  # of the tiny model's 512 ids: a partial last 128-row block


def greedy(i):
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


def sampled(i):
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7 * i + 1)


@pytest.mark.parametrize("params", [greedy, sampled], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft_vocab", [0, DRAFT_VOCAB], ids=["whole-vocab", "draft-vocab"])
def test_mtp_with_fp8_draft_lm_head_equals_plain_k2_batch6(checkpoint, draft_vocab, params):
    path = checkpoint("tiny")
    expected = generate_all(cpu_engine(path), PROMPTS, params)
    vocab = {"draft_vocab": draft_vocab, "draft_vocab_file": "first"} if draft_vocab else {}
    engine = cpu_engine(path, 2, draft_lm_head="fp8", **vocab)
    head = engine.runner.steps.draft_head
    assert head.weight.dtype == torch.float8_e4m3fn and head.size == (draft_vocab or engine.config.vocab_size)
    assert generate_all(engine, PROMPTS, params) == expected
    stats = engine.stats()
    assert stats["verify_steps"] > 0 and stats["free_pages"] == stats["total_pages"]


def _drafts_of(engine, hidden, mode, positions, rows):
    with torch.inference_mode():
        return engine.runner.steps._propose(hidden, mode, positions, rows)


def _sampling_rows(batch: int) -> dict[str, torch.Tensor]:
    return {"inv_temperature": torch.full((batch,), 1.25), "top_k": torch.zeros(batch, dtype=torch.long),
            "top_p": torch.ones(batch), "min_p_offset": torch.full((batch,), float("-inf")),
            "seed": torch.arange(batch) * 1000 + 3}  # fmt: skip


@pytest.mark.parametrize("draft_vocab", [0, DRAFT_VOCAB], ids=["whole-vocab", "draft-vocab"])
def test_fp8_drafts_are_the_dequantized_copys_argmax_over_real_ids(checkpoint, draft_vocab):
    """Greedy: the argmax of hidden @ dequantize(quantize_fp8_block(rows))^T mapped to the rows' ids; sampled
    (coupled): the argmax of those logits / T + g(seed, p, full id). With N = 200 (not a multiple of 128) the
    logits are [B, N]: no padded row is scored, so every draft is one of the N ids."""
    vocab = {"draft_vocab": draft_vocab, "draft_vocab_file": "first"} if draft_vocab else {}
    engine = cpu_engine(checkpoint("tiny"), 2, draft_lm_head="fp8", **vocab)
    weight, size = engine.model.lm_head_weight, engine.config.vocab_size
    ids = torch.arange(draft_vocab or size)
    rows = weight[ids]
    dense = dequantize_fp8_block(*quantize_fp8_block(rows)).to(weight.dtype)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, weight.shape[1], generator=gen)
    positions = torch.arange(6) + 40
    logits = hidden @ dense.T  # [6, N]
    head = engine.runner.steps.draft_head
    assert head.logits(hidden).shape == (6, ids.numel())
    drafts = _drafts_of(engine, hidden, Mode(), positions, {})
    assert torch.equal(drafts, ids[logits.argmax(dim=-1)])
    sampling_rows = _sampling_rows(6)
    scores = logits * 1.25 + gumbel_noise(sampling_rows["seed"], positions, size)[:, ids]
    coupled = _drafts_of(engine, hidden, Mode(noise=True), positions, sampling_rows)
    assert torch.equal(coupled, ids[scores.argmax(dim=-1)])
    assert int(drafts.max()) < ids.numel() and int(coupled.max()) < ids.numel()


@pytest.mark.parametrize("draft_vocab", [0, DRAFT_VOCAB], ids=["whole-vocab", "draft-vocab"])
def test_fp8_draft_logits_within_fp8_tolerance_of_the_unquantized_ones(checkpoint, draft_vocab):
    """e4m3 keeps 3 mantissa bits: a weight's error is up to 1/16 of it; over a dot product the logits' relative
    error (in norm) lands near 2-3%. The bound: at most 5e-2, and not zero (the copy is really FP8)."""
    path = checkpoint("tiny")
    vocab = {"draft_vocab": draft_vocab, "draft_vocab_file": "first"} if draft_vocab else {}
    fp8 = cpu_engine(path, 2, draft_lm_head="fp8", **vocab).runner.steps.draft_head
    weight = cpu_engine(path).model.lm_head_weight
    hidden = torch.randn(16, weight.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = hidden @ weight[: draft_vocab or weight.shape[0]].T
        error = ((fp8.logits(hidden) - ref).norm() / ref.norm()).item()
    assert 1e-3 < error < 5e-2, error
    assert fp8.nbytes < weight[: fp8.size].numel() * weight.element_size() / 3  # 1 byte an element, fp32 model


def test_draft_lm_head_recipe_names_the_choices(checkpoint):
    with pytest.raises(RecipeError, match=r"mtp.draft_lm_head.*bf16.*fp8"):
        cpu_engine(checkpoint("tiny"), 2, draft_lm_head="int8")
    with pytest.raises(RecipeError, match=r"bench.draft_lm_heads.*bf16.*fp8"):
        Engine.from_recipe(
            {"model": {"path": str(checkpoint("tiny")), "device": "cpu"}, "bench": {"draft_lm_heads": ["fp4"]}},
            log=lambda _: None,
        )


def test_bf16_draft_lm_head_scores_with_the_lm_head_itself(checkpoint):
    """The default makes no copy: the drafts read the target's lm_head (`draft_head` None)."""
    assert cpu_engine(checkpoint("tiny"), 2).runner.steps.draft_head is None


def test_fp8_copy_quantized_in_slices_equals_one_call(checkpoint, monkeypatch):
    """Load quantizes the copy a slice of whole 128-row blocks at a time (bounded temporaries): the same bytes
    and scales as `quantize_fp8_block` over the whole matrix, a partial last block included."""
    weight = cpu_engine(checkpoint("tiny")).model.lm_head_weight[:300]
    monkeypatch.setattr(DraftLmHead, "QUANTIZE_ROWS", 128)
    head = DraftLmHead(weight, fp8=True)
    q, scale = quantize_fp8_block(weight)
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(head.scale, scale)
    assert head.scale.shape == (3, 1)


def test_shipped_model_fp8_draft_lm_head_keeps_the_acceptance():
    """models/qwen-mtp-small, K=3, greedy, the documented prompts: with the FP8 draft lm_head, MTP-on == MTP-off
    and the acceptance length is within 5% of the bf16 draft head's documented one, over the whole vocabulary
    and over the tested draft vocabulary (docs/mtp.md quotes both)."""
    documented = json.loads(FIGURES.read_text())
    prompts = read_prompts()[: documented["prompts"]]
    doc = (ROOT / "docs" / "mtp.md").read_text()
    for size in [documented["vocab_size"], *documented["tested"]]:
        whole = size == documented["vocab_size"]
        measured = measure_acceptance(
            SMALL, prompts, (3,), documented["max_new_tokens"], draft_vocab=0 if whole else size,
            draft_vocab_file=None if whole else str(SMALL / "draft_vocab.tsv"), draft_lm_head="fp8",
        )["k"]["3"]  # fmt: skip
        assert measured["matches_mtp_off"]
        bf16, fp8 = documented["draft_vocab"][str(size)]["3"]["acceptance_length"], measured["acceptance_length"]
        assert abs(fp8 - bf16) <= 0.05 * bf16, f"N={size}: fp8 acceptance length {fp8:.3f}, bf16 {bf16:.3f}"
        assert f"{fp8:.2f}" in doc, f"N={size}: docs/mtp.md does not quote the fp8 acceptance length {fp8:.2f}"


def test_shipped_model_fp8_draft_lm_head_sampled_equals_plain():
    """Sampled (coupled drafts over the FP8 copy's logits, the target's noise), on the trained head so that drafts
    are accepted: MTP-on == MTP-off at batch 4."""
    recipe = {"model": {"path": str(SMALL), "dtype": "float32", "device": "cpu"}}
    plain = Engine.from_recipe(recipe, log=lambda _: None)
    spec = Engine.from_recipe(recipe | {"mtp": {"enabled": True, "k": 2, "draft_lm_head": "fp8"}}, log=lambda _: None)
    prompts = [plain.encode(p) for p in read_prompts()[:4]]

    def generate(engine):
        params = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.7, seed=i) for i in range(4)]
        ids = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
        return [engine.result(i).token_ids for i in ids]

    assert generate(spec) == generate(plain)
    assert spec.stats()["acceptance_length"] > 1.5
