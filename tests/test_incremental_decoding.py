"""Prefill then cached continuation (one token at a time, or in blocks) equals one full-sequence forward."""

import pytest
import torch

from qwen_mtp import load_model
from qwen_mtp.cache import SequenceCache


def _cached_logits(model, ids, pieces):
    """Feed ids [B, T] in pieces of the given lengths through one cache; concatenated logits."""
    cache, outs, start = SequenceCache(ids.shape[0], state_dtype=model.lm_head_weight.dtype), [], 0
    for length in pieces:
        outs.append(model(ids[:, start : start + length], cache=cache))
        cache.advance(length)
        start += length
    assert start == ids.shape[1] and cache.length == start
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("preset", ["tiny", "tiny-8l"])
@pytest.mark.parametrize("pieces", [[40] + [1] * 12, [1] * 20, [17, 5, 1, 30, 1, 1]])
def test_cached_decoding_equals_full_forward(checkpoint, preset, pieces):
    """In fp64 the two paths agree to rounding noise (proves the math); in fp32 to the chunked-vs-recurrent
    delta-rule rounding, amplified through the random-weight stack."""
    model = load_model(checkpoint(preset), dtype=torch.float32)
    ids = torch.randint(0, 512, (2, sum(pieces)), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full, cached = model(ids), _cached_logits(model, ids, pieces)
        torch.testing.assert_close(cached, full, rtol=1e-3, atol=1e-3)
        model = model.double()
        full, cached = model(ids), _cached_logits(model, ids, pieces)
        torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)


def test_bf16_state_pool_precision_runs_close(checkpoint):
    """state.dtype=bfloat16 stores the SSM state rounded; results stay close to the fp32-state run."""
    model = load_model(checkpoint("tiny"), dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = _cached_logits(model, ids, [10] + [1] * 20)
        cache, outs = SequenceCache(1, state_dtype=torch.bfloat16), []
        for start, end in [(0, 10)] + [(i, i + 1) for i in range(10, 30)]:
            outs.append(model(ids[:, start:end], cache=cache))
            cache.advance(end - start)
    assert next(iter(cache.gdn.values()))[1].dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=0.05, atol=0.05)
