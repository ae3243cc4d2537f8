"""A packed prefill step runs each GDN layer's delta rule as one varlen call over all its chunks
(`qwen_mtp::gdn_chunked_varlen`), and every chunk still gets bitwise the hidden states and GDN states (conv
window, SSM state) it gets alone, where the layer runs `gdn_chunked` on it: chunks of 1, 50, 64 and 130 tokens,
one of them continuing a state left by an earlier chunk, fp32 and bf16. tests/gpu/test_mixed_steps_cuda.py runs
the same check with the Triton kernels."""

from types import SimpleNamespace

import pytest
import torch
from helpers import random_prompt

import qwen_mtp.model.gdn as gdn_module
from qwen_mtp import Engine

EARLIER = 100  # request 0's first chunk, run alone before the packed step: its state is the packed chunk's start
PROMPTS = {0: random_prompt(150, seed=1), 1: random_prompt(1, seed=2), 2: random_prompt(130, seed=3)}
PROMPTS[3] = random_prompt(64, seed=4)
PACKED = [(0, EARLIER, 50), (1, 0, 1), (2, 0, 130), (3, 0, 64)]  # (request, start, length): one step's chunks


def make_engine(model: dict, dtype: str, device: str, **cache) -> Engine:
    recipe = {
        "model": {**model, "dtype": dtype, "device": device},
        "cache": {"mixed_steps": True, "prefill_chunk": 256, "max_batch": 4, **cache},
    }
    engine = Engine.from_recipe(recipe, log=lambda _: None)
    for rid, prompt in PROMPTS.items():
        engine.states.allocate(rid)
        engine.pages.reserve(rid, len(prompt))
        engine.pages.grow(rid, len(prompt))
    return engine


def run(engine, chunks):
    """One packed forward over `chunks` ((request, start, length)): each chunk's hidden states (copies)."""
    steps = [SimpleNamespace(request=SimpleNamespace(id=r, prompt=PROMPTS[r]), start=s, length=n) for r, s, n in chunks]
    return [h.clone() for h in engine.runner.prefill_packed(steps)]


def gdn_states(engine, rid):
    """Every GDN layer's committed (conv window, SSM state) of the request."""
    rows = torch.tensor([engine.states.rows[rid]], device=engine.states.committed.device)
    return {layer: engine.states.read(layer, rows) for layer in engine.states.layer_index}


def assert_packed_equals_alone(model: dict, dtype: str, device: str, monkeypatch, **cache) -> None:
    """The packed step's chunks against each chunk in a forward of its own, in two engines of one model."""
    varlen_calls = []
    varlen = gdn_module.gdn_chunked_varlen
    monkeypatch.setattr(gdn_module, "gdn_chunked_varlen", lambda *args: varlen_calls.append(1) or varlen(*args))

    alone = make_engine(model, dtype, device, **cache)
    run(alone, [(0, 0, EARLIER)])
    alone_hidden = [run(alone, [chunk])[0] for chunk in PACKED]
    assert not varlen_calls  # one chunk a forward: the single-sequence path (`gdn_chunked`)
    alone_states = {rid: gdn_states(alone, rid) for rid in PROMPTS}
    del alone

    packed = make_engine(model, dtype, device, **cache)
    run(packed, [(0, 0, EARLIER)])
    packed_hidden = run(packed, PACKED)
    assert len(varlen_calls) == len(packed.states.layer_index)  # one varlen call per GDN layer

    for (rid, _, length), a, p in zip(PACKED, alone_hidden, packed_hidden, strict=True):
        assert a.shape[1] == length and torch.equal(a, p), rid
        for layer, (window, ssm) in alone_states[rid].items():
            packed_window, packed_ssm = gdn_states(packed, rid)[layer]
            assert torch.equal(window, packed_window) and torch.equal(ssm, packed_ssm), (rid, layer)
            assert ssm.abs().sum() > 0  # the chunk's state was written


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_gdn_varlen_equals_each_chunk_alone_bitwise(checkpoint, dtype, monkeypatch):
    assert_packed_equals_alone({"path": str(checkpoint("tiny-8l"))}, dtype, "cpu", monkeypatch)
