"""The attention layer's head norms + partial rotary in one kernel (`qwen_mtp::qk_norm_rope`)."""

import pytest
import torch
from op_helpers import DEVICE, DTYPES, check_op, close, fused_projection, rand

from qwen_mtp.model.layers import RotaryEmbedding
from qwen_mtp.ops.norm import norm_triton
from qwen_mtp.ops.rope import qk_norm_rope_reference, qk_norm_rope_triton, rotate


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_reference_on_strided_slices(length, dtype):
    """The attention layer's head norms + partial rotary in one kernel: equal to the torch composition, reading
    q (every other head_dim block of the q/gate projection) and k in place, and batch-invariant."""
    batch, heads, kv_heads, dim, rd = 3, 4, 2, 32, 8
    q_gate, k, _ = fused_projection(batch, length, [2 * heads * dim, kv_heads * dim, kv_heads * dim], dtype)
    q = q_gate.reshape(batch, length, heads, 2 * dim)[..., :dim]
    k = k.reshape(batch, length, kv_heads, dim)
    q_w, k_w = rand(dim, seed=5, scale=0.1), rand(dim, seed=6, scale=0.1)
    positions = torch.arange(length, device=DEVICE) + torch.tensor([[0], [7], [40]], device=DEVICE)
    cos, sin = RotaryEmbedding(rd, 10000.0).to(DEVICE)(positions, dtype)
    ours = qk_norm_rope_triton(q, k, q_w, k_w, 1e-6, cos, sin)
    ref = qk_norm_rope_reference(q, k, q_w, k_w, 1e-6, cos, sin)
    for mine, theirs in zip(ours, ref, strict=True):
        assert mine.is_contiguous() and mine.shape == theirs.shape
        close(mine, theirs, dtype)
    one = qk_norm_rope_triton(q[1:2], k[1:2], q_w, k_w, 1e-6, cos[1:2], sin[1:2])
    assert torch.equal(one[0], ours[0][1:2]) and torch.equal(one[1], ours[1][1:2])


@pytest.mark.parametrize("dtype", DTYPES + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_qk_norm_rope_equals_norm_kernel_then_rotate_bitwise(dtype):
    """Bit for bit the path it replaced: the norm kernel, then the torch rotary (bf16 only on CUDA: the CPU
    interpreter's bf16 arithmetic is not the GPU's)."""
    batch, length, heads, kv_heads, dim, rd = 2, 5, 4, 2, 64, 16
    q = rand(batch, length, heads, 2 * dim, dtype=dtype, seed=1)[..., :dim]
    k = rand(batch, length, kv_heads, dim, dtype=dtype, seed=2)
    q_w, k_w = rand(dim, dtype=dtype, seed=3, scale=0.1), rand(dim, dtype=dtype, seed=4, scale=0.1)
    positions = torch.arange(length, device=DEVICE) + torch.tensor([[3], [5000]], device=DEVICE)
    cos, sin = RotaryEmbedding(rd, 1e7).to(DEVICE)(positions, dtype)
    fused = qk_norm_rope_triton(q, k, q_w, k_w, 1e-6, cos, sin)
    for ours, x, w in zip(fused, (q, k), (q_w, k_w), strict=True):
        assert torch.equal(ours, rotate(norm_triton(x, w, 1e-6), cos.unsqueeze(2), sin.unsqueeze(2)))


def test_qk_norm_rope_passes_opcheck_with_the_models_strided_inputs():
    q_gate, k_proj = fused_projection(2, 3, [2 * 4 * 16, 2 * 16])
    q_half, k_heads = q_gate.reshape(2, 3, 4, 32)[..., :16], k_proj.reshape(2, 3, 2, 16)
    cos, sin = rand(2, 3, 8, seed=9), rand(2, 3, 8, seed=10)
    args = (q_half, k_heads, rand(16, scale=0.1), rand(16, scale=0.1), 1e-6, cos, sin)
    check_op(torch.ops.qwen_mtp.qk_norm_rope, args)
