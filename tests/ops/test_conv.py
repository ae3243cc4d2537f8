"""The causal conv1d (`causal_conv1d`, prefill) and its decode / verify op over pooled windows
(`qwen_mtp::conv_update`)."""

import pytest
import torch
from op_helpers import DEVICE, DTYPES, REAL, VERIFY_DTYPE, close, fused_projection, rand

from qwen_mtp.ops.conv import (
    causal_conv1d,
    conv_prefill_reference,
    conv_prefill_triton,
    conv_prefill_varlen_reference,
    conv_prefill_varlen_triton,
    conv_update_reference,
    conv_update_triton,
)


def test_causal_conv_window_continuation():
    x = torch.randn(2, 6, 20)
    w = torch.randn(6, 4)
    whole, inputs = causal_conv1d(x, w)
    assert torch.equal(inputs[..., 3:], x) and not inputs[..., :3].any()
    first, inputs = causal_conv1d(x[..., :11], w)
    rest = [first]
    for t in range(11, 20):
        out, inputs = causal_conv1d(x[..., t : t + 1], w, inputs[..., -3:])
        rest.append(out)
        assert torch.equal(inputs, x[..., t - 3 : t + 1])
    torch.testing.assert_close(torch.cat(rest, -1), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("length", [1, 2, 37])
@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_prefill_matches_reference(length, with_window, dtype):
    """The prefill kernel on the fused projection's strided qkv slice, with and without a carried window (the
    pool's fp32 windows in a half model): the conv output, and the next window bit for bit."""
    _, qkv, _ = fused_projection(2, length, [24, 40, 8], dtype=dtype, seed=2)
    weight = rand(40, 4, dtype=dtype, seed=3)
    window = rand(2, 40, 3, seed=4) if with_window else None
    out, next_window = conv_prefill_triton(qkv, weight, window)
    ref_out, ref_window = conv_prefill_reference(qkv, weight, window)
    assert out.is_contiguous() and out.dtype == dtype and next_window.dtype == dtype
    close(out, ref_out, dtype)
    assert torch.equal(next_window, ref_window)


def test_conv_prefill_chunks_equal_the_whole_prompt_bitwise():
    """Chunked prefill (each chunk continuing the last one's window) computes every token exactly as one pass over
    the prompt, and a batch of prompts each as alone: a token's conv never depends on T, B or the chunking."""
    x, weight = rand(3, 70, 40, seed=5), rand(40, 4, seed=6)
    whole, last = conv_prefill_triton(x, weight, None)
    window, parts = None, []
    for start, end in ((0, 2), (2, 33), (33, 70)):
        out, window = conv_prefill_triton(x[:, start:end], weight, window)
        parts.append(out)
    assert torch.equal(torch.cat(parts, dim=1), whole) and torch.equal(window, last)
    alone = conv_prefill_triton(x[1:2], weight, None)[0]
    assert torch.equal(alone, whole[1:2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_prefill_varlen_equals_each_sequence_alone(dtype):
    """Sequences packed back to back (lengths 1, 2 and longer than a token block; some continuing a window, some
    fresh) in one launch: each one's output bitwise `conv_prefill_triton` on it alone, the next windows bitwise
    the reference's (a 1- or 2-token sequence's come partly from its window)."""
    lengths, fresh = [1, 37, 2, 5, 40], [False, True, True, False, False]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    _, qkv, _ = fused_projection(1, bounds[-1], [24, 40, 8], dtype=dtype, seed=7)
    weight = rand(40, 4, dtype=dtype, seed=8)
    windows = [None if f else rand(1, 40, 3, seed=20 + i) for i, f in enumerate(fresh)]
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    out, next_windows = conv_prefill_varlen_triton(qkv, weight, cu, windows)
    ref_out, ref_windows = conv_prefill_varlen_reference(qkv, weight, cu.cpu(), windows)
    close(out, ref_out, dtype)
    assert torch.equal(next_windows, ref_windows)
    for i, window in enumerate(windows):
        alone, alone_window = conv_prefill_triton(qkv[:, bounds[i] : bounds[i + 1]], weight, window)
        assert torch.equal(out[:, bounds[i] : bounds[i + 1]], alone), i
        assert torch.equal(next_windows[i : i + 1], alone_window), i


@pytest.mark.parametrize("kind", ["tile", "columns"])
@pytest.mark.parametrize("length", [1, 2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_matches_reference(length, dtype, kind):
    channels, kernel, spec = 40, 4, 4
    pool = rand(5, channels, kernel - 1 + spec, dtype=dtype, seed=1)
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    committed = torch.tensor([1, 0, 3, 0, 2], device=DEVICE)
    x, weight = rand(3, length, channels, dtype=dtype, seed=2), rand(channels, kernel, dtype=dtype, seed=3)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    close(
        conv_update_triton(x, weight, tri_pool, rows, committed, kind=kind),
        conv_update_reference(x, weight, ref_pool, rows, committed),
        dtype,
    )
    assert torch.equal(tri_pool, ref_pool)


@pytest.mark.parametrize("kind", ["tile", "columns", "auto"])
@pytest.mark.parametrize("spec", [1, 3])
def test_conv_update_verify_equals_decode_steps(spec, kind):
    channels, kernel = (6144, 4) if REAL else (40, 4)
    x = rand(8, spec + 1, channels, dtype=VERIFY_DTYPE, seed=1)
    weight = rand(channels, kernel, dtype=VERIFY_DTYPE, seed=2)
    pool = rand(8, channels, kernel - 1 + spec, dtype=VERIFY_DTYPE, seed=3)
    rows, committed = torch.arange(8, device=DEVICE), torch.zeros(8, dtype=torch.long, device=DEVICE)
    verify_pool, decode_pool = pool.clone(), pool.clone()
    verify = conv_update_triton(x, weight, verify_pool, rows, committed, kind=kind)
    for t in range(spec + 1):
        decode = conv_update_triton(x[:, t : t + 1], weight, decode_pool, rows, committed, kind=kind)
        assert torch.equal(decode[:, 0], verify[:, t]), t
    assert torch.equal(verify_pool[:, :, spec : spec + kernel - 1], decode_pool[:, :, : kernel - 1])


@pytest.mark.parametrize("length", [1, 4])
def test_conv_update_launch_choices_change_no_bit(length):
    """Channels per program, warps and the kernel kind ("tile", "columns") only spread the work: the same outputs
    and pool bytes."""
    channels = 6144 if REAL else 300
    x, weight = rand(3, length, channels, seed=7), rand(channels, 4, seed=8)
    pool = rand(4, channels, 3 + 3, seed=9)
    rows, committed = torch.tensor([3, 0, 1], device=DEVICE), torch.tensor([2, 0, 3, 1], device=DEVICE)
    want_pool = pool.clone()
    want = conv_update_triton(x, weight, want_pool, rows, committed)
    for block, warps, kind in [(64, 1, "tile"), (256, 8, "tile"), (128, 4, "columns"), (1024, 4, "columns")]:
        got_pool = pool.clone()
        got = conv_update_triton(x, weight, got_pool, rows, committed, block, warps, kind)
        assert torch.equal(got, want), (block, warps, kind)
        assert torch.equal(got_pool, want_pool), (block, warps, kind)


def test_conv_update_reads_strided_projection_slices():
    """The qkv slice of the GDN's fused input projection goes into the kernel in place."""
    _, qkv, _ = fused_projection(2, 3, [64, 40, 8], seed=2)
    conv_w = rand(40, 4, seed=4)
    pool = rand(3, 40, 7, seed=5)
    rows, committed = torch.tensor([2, 0], device=DEVICE), torch.tensor([1, 0, 2], device=DEVICE)
    strided_pool, copied_pool = pool.clone(), pool.clone()
    strided = conv_update_triton(qkv, conv_w, strided_pool, rows, committed)
    copied = conv_update_triton(qkv.contiguous(), conv_w, copied_pool, rows, committed)
    assert not qkv.is_contiguous() and torch.equal(strided, copied) and torch.equal(strided_pool, copied_pool)
