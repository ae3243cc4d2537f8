"""On CUDA, `mtp.draft_lm_head: fp8`: the FP8 draft lm_head at the real lm_head shapes (27B's 248,320 x 5,120 and
a draft vocabulary whose N ends in a partial 128-row block) is the W8A8 product of `quantize_fp8_block`'s copy
(rows never depend on M, within FP8 tolerance of the bf16 product), and MTP-on == MTP-off at batch 1 and 8 with
CUDA graphs, the drafts scored by the W8A8 kernel, with and without a draft vocabulary."""

import pytest
import torch
from helpers import random_prompt

from qwen_mtp import Engine
from qwen_mtp.model.mtp import DraftLmHead
from qwen_mtp.ops import linear as linear_ops
from qwen_mtp.ops.linear import dequantize_weight, linear, linear_fp8_w8a8_reference
from qwen_mtp.quant.fp8 import quantize_fp8_block

VOCAB, HIDDEN = 248320, 5120  # Qwen3.5-27B's lm_head


@pytest.mark.parametrize("draft_vocab", [0, 30000], ids=["whole-vocab", "draft-vocab-30000"])
def test_fp8_draft_lm_head_is_the_w8a8_product_of_its_copy_at_27b_shape(draft_vocab):
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) * HIDDEN**-0.5
    ids = torch.randperm(VOCAB, device="cuda", generator=gen)[:draft_vocab] if draft_vocab else None
    head = DraftLmHead(weight, ids, fp8=True, w8a8=True)
    rows = weight if ids is None else weight[ids.sort().values]
    q, scale = quantize_fp8_block(rows)  # one call: the head quantized in slices
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(head.scale, scale)
    del q
    x = torch.randn(8, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        full = head.logits(x)
        assert full.shape == (8, rows.shape[0])
        for m in (1, 2, 3, 8):
            assert torch.equal(head.logits(x[:m]), full[:m]), f"M={m}"
        assert torch.equal(head.logits(x[5:6]), full[5:6])
        reference = linear_fp8_w8a8_reference(x, head.weight, head.scale).float()
        assert (full.float() - reference).norm() / reference.norm() < 4e-3
        dense = linear(x, rows, True).float()
        assert (full.float() - dense).norm() / dense.norm() < 6e-2  # e4m3 weight and activations: ~3.7e-2
        w8a16 = DraftLmHead(weight, ids, fp8=True, w8a8=False).logits(x)
        exact = linear(x, dequantize_weight(head.weight, head.scale, torch.bfloat16), True)
        assert torch.equal(w8a16, exact)  # W8A16: the bf16 kernel on the dequantized copy, bit for bit


def engine_for(k=None, max_batch=8, **mtp):
    cache = {"max_batch": max_batch, "num_state_rows": max_batch, "num_pages": 40 * max_batch}
    recipe = {
        "model": {"synthetic": "qwen3.5-0.8b", "dtype": "bfloat16", "device": "cuda"},
        "cache": cache,
        "compile": {"cuda_graphs": True},
    }
    if k is not None:
        recipe["mtp"] = {"enabled": True, "k": k, **mtp}
    return Engine.from_recipe(recipe, log=lambda _: None)


@pytest.mark.parametrize("draft", ["head", "oracle"])
@pytest.mark.parametrize("draft_vocab", [0, 30000], ids=["whole-vocab", "draft-vocab-30000"])
def test_fp8_draft_lm_head_mtp_equals_plain_batch_1_8_graphs(draft_vocab, draft, monkeypatch):
    """A bf16 model (no other FP8 weight): every W8A8 launch is the draft head's."""
    runs = []
    w8a8 = linear_ops.linear_fp8_w8a8_triton
    monkeypatch.setattr(linear_ops, "linear_fp8_w8a8_triton", lambda *args: runs.append(1) or w8a8(*args))
    prompts = [random_prompt(n, seed=n, vocab=200000) for n in (1, 4, 7, 130, 64, 300, 2, 33)]
    vocab = {"draft_vocab": draft_vocab, "draft_vocab_file": "first"} if draft_vocab else {}
    plain = engine_for()
    spec = engine_for(3, draft_lm_head="fp8", draft=draft, oracle_accept=0.7, **vocab)
    for batch in (1, 8):
        expected = [r.token_ids for r in plain.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        got = [r.token_ids for r in spec.generate(prompts[:batch], max_new_tokens=24, ignore_eos=True)]
        assert got == expected, f"batch={batch}"
    assert runs  # the draft chain (captured in the engine's graphs) ran the W8A8 kernel
