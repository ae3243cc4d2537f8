"""Each Triton kernel equals its plain-PyTorch reference (on CPU under TRITON_INTERPRET=1, tiny shapes, fp32 /
fp16 inputs; on CUDA when there is one), updates the pools the same way, and is batch-invariant."""

import pytest
import torch

from qwen_mtp.ops import linear
from qwen_mtp.ops.conv import conv_update_reference, conv_update_triton
from qwen_mtp.ops.gdn.chunked import gdn_chunked_triton
from qwen_mtp.ops.gdn.naive import chunked_gated_delta_rule, gate_values
from qwen_mtp.ops.gdn.recurrent import gdn_recurrent_reference, gdn_recurrent_triton
from qwen_mtp.ops.linear import GemmPlan, invariant_matmul_triton
from qwen_mtp.ops.paged_attention import paged_attention_reference, paged_attention_triton, write_kv
from qwen_mtp.ops.prefill_attention import prefill_attention_reference, prefill_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def close(a, b, dtype):
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("length", [1, 2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_matches_reference(length, dtype):
    channels, kernel, spec = 40, 4, 4
    pool = rand(5, channels, kernel - 1 + spec, dtype=dtype, seed=1)
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    committed = torch.tensor([1, 0, 3, 0, 2], device=DEVICE)
    x, weight = rand(3, length, channels, dtype=dtype, seed=2), rand(channels, kernel, dtype=dtype, seed=3)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    close(
        conv_update_triton(x, weight, tri_pool, rows, committed),
        conv_update_reference(x, weight, ref_pool, rows, committed),
        dtype,
    )
    assert torch.equal(tri_pool, ref_pool)


@pytest.mark.parametrize("length", [1, 3, 5])
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_gdn_recurrent_matches_reference(length, dtype, state_dtype):
    batch, hk, hv, dk, dv = 3, 2, 4, 16, 32
    q, k = rand(batch, length, hk, dk, dtype=dtype, seed=1), rand(batch, length, hk, dk, dtype=dtype, seed=2)
    v, a, b = (
        rand(batch, length, hv, dv, dtype=dtype, seed=3),
        rand(batch, length, hv, dtype=dtype, seed=4),
        rand(batch, length, hv, dtype=dtype, seed=5),
    )
    a_log, dt_bias = rand(hv, dtype=dtype, seed=6).abs(), rand(hv, dtype=dtype, seed=7).abs()
    pool = rand(6, 6, hv, dk, dv, dtype=state_dtype, seed=8, scale=0.1)
    rows, committed = torch.tensor([5, 1, 3], device=DEVICE), torch.tensor([0, 2, 0, 4, 0, 1], device=DEVICE)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = gdn_recurrent_reference(q, k, v, a, b, a_log, dt_bias, ref_pool, rows, committed)
    tri = gdn_recurrent_triton(q, k, v, a, b, a_log, dt_bias, tri_pool, rows, committed)
    tol = 2e-3 if state_dtype == torch.bfloat16 or dtype != torch.float32 else 2e-6
    torch.testing.assert_close(tri.float(), ref.float(), rtol=tol, atol=tol)
    # states: equal up to fp32 summation order (one bf16 ulp where the pool rounds)
    bf16 = state_dtype == torch.bfloat16
    torch.testing.assert_close(
        tri_pool.float(), ref_pool.float(), rtol=1e-2 if bf16 else 1e-5, atol=4e-3 if bf16 else 1e-5
    )
    untouched = [r for r in range(6) if r not in (5, 1, 3)]
    assert torch.equal(tri_pool[untouched], pool[untouched])


def _paged_setup(length, dtype):
    kv = rand(2, 12, 8, 2, 32, dtype=dtype, seed=1)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [9, 10, 11, 4]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 9, 29], dtype=torch.int32, device=DEVICE)
    q = rand(3, length, 4, 32, dtype=dtype, seed=2)
    k, v = rand(3, length, 2, 32, dtype=dtype, seed=3), rand(3, length, 2, 32, dtype=dtype, seed=4)
    write_kv(k, v, kv, tables, lens[:, None].long() - length + torch.arange(length, device=DEVICE))
    return q, kv, tables, lens


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_reference(length, dtype):
    q, kv, tables, lens = _paged_setup(length, dtype)
    close(
        paged_attention_triton(q, kv, tables, lens, 32**-0.5),
        paged_attention_reference(q, kv, tables, lens, 32**-0.5),
        dtype,
    )


def test_paged_attention_verify_block_equals_decode_per_position():
    """Query t of a 3-token verify equals a 1-token decode at the same position, bit for bit."""
    q, kv, tables, lens = _paged_setup(3, torch.float32)
    verify = paged_attention_triton(q, kv, tables, lens, 32**-0.5)
    for t in range(3):
        decode = paged_attention_triton(q[:, t : t + 1].contiguous(), kv, tables, lens - 2 + t, 32**-0.5)
        assert torch.equal(decode[:, 0], verify[:, t])
    alone = paged_attention_triton(q[1:2], kv, tables[1:2], lens[1:2], 32**-0.5)
    assert torch.equal(alone, verify[1:2])


@pytest.mark.parametrize("length", [1, 7, 20])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [(128, 64, 8), (16, 16, 4)])  # (pairs per program, keys per block, warps)
def test_prefill_attention_matches_reference(length, dtype, tile):
    """A prompt chunk of `length` positions per request (the last ones of its context, some requests mid-prompt)
    over scattered pages, 3 query heads per KV head: tiles of 16 pairs cut positions' head groups apart."""
    kv = rand(2, 12, 8, 2, 32, dtype=dtype, seed=1)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 6, 0], [9, 10, 11, 4]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([length, length + 3, 29], dtype=torch.int32, device=DEVICE)
    q = rand(3, length, 6, 32, dtype=dtype, seed=2)
    k, v = rand(3, length, 2, 32, dtype=dtype, seed=3), rand(3, length, 2, 32, dtype=dtype, seed=4)
    write_kv(k, v, kv, tables, lens[:, None].long() - length + torch.arange(length, device=DEVICE))
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # the model hands q over as a transposed view
    ours = prefill_attention_triton(q_view, kv, tables, lens, 32**-0.5, *tile)
    assert ours.is_contiguous()
    close(ours, prefill_attention_reference(q, kv, tables, lens, 32**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "k,plan,splits",
    [
        (200, GemmPlan(16, 128, 1), 2),
        (300, GemmPlan(16, 128, 1), 3),  # the last split is shorter
        (300, GemmPlan(32, 64, 2, num_stages=4), 3),
        (300, GemmPlan(16, 128, 3), 1),
        (300, None, None),  # the default plan for this shape
    ],
)
def test_invariant_matmul_matches_and_is_batch_invariant(dtype, k, plan, splits):
    weight, x = rand(40, k, dtype=dtype, seed=1), rand(19, k, dtype=dtype, seed=2)
    if plan is not None:
        assert plan.splits(k) == splits
    full = invariant_matmul_triton(x, weight, plan)
    torch.testing.assert_close(
        full.float(), x.float() @ weight.float().T, rtol=2e-3, atol=2e-2 if dtype == torch.float16 else 1e-4
    )
    for i in range(0, 19, 3):
        assert torch.equal(invariant_matmul_triton(x[i : i + 1], weight, plan), full[i : i + 1])
    if splits and splits > 1:  # the last split of each tile re-armed its counter for the next launch
        assert not linear._COUNTERS[x.device].any()


def test_custom_ops_registered_and_dispatch_to_reference_on_cpu():
    import qwen_mtp.engine.runner  # noqa: F401  (registers the ops)

    q, kv, tables, lens = _paged_setup(1, torch.float32)
    k, v = rand(3, 1, 2, 32, seed=3), rand(3, 1, 2, 32, seed=4)
    positions = lens[:, None].long() - 1
    for op in ("paged_attention", "conv_update", "gdn_recurrent"):
        assert hasattr(torch.ops.qwen_mtp, op)
    torch.library.opcheck(
        torch.ops.qwen_mtp.paged_attention.default, (q, k, v, kv.clone(), tables, lens, positions, 0.1)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_kernels_match_reference_and_are_batch_invariant(dtype, gated):
    from qwen_mtp.ops.norm import gated_rms_norm_reference, norm_triton, rms_norm_reference

    x, weight = rand(7, 3, 1500, dtype=dtype, seed=1), rand(1500, dtype=dtype, seed=2, scale=0.1)
    gate = rand(7, 3, 1500, dtype=dtype, seed=3) if gated else None
    ours = norm_triton(x, weight, 1e-6, gate)
    ref = gated_rms_norm_reference(x, gate, weight, 1e-6) if gated else rms_norm_reference(x, weight, 1e-6)
    close(ours, ref, dtype)
    one = norm_triton(x[2:3], weight, 1e-6, None if gate is None else gate[2:3])
    assert torch.equal(one, ours[2:3])


# ---- verify == decode, bit for bit: the property MTP-on == MTP-off rests on --------------------------------
# Shapes are Qwen3.5-0.8B's on CUDA (bf16), tiny under the CPU interpreter.
REAL = torch.cuda.is_available()
VERIFY_DTYPE = torch.bfloat16 if REAL else torch.float32


@pytest.mark.parametrize("spec", [1, 3])
def test_conv_update_verify_equals_decode_steps(spec):
    channels, kernel = (6144, 4) if REAL else (40, 4)
    x = rand(8, spec + 1, channels, dtype=VERIFY_DTYPE, seed=1)
    weight = rand(channels, kernel, dtype=VERIFY_DTYPE, seed=2)
    pool = rand(8, channels, kernel - 1 + spec, dtype=VERIFY_DTYPE, seed=3)
    rows, committed = torch.arange(8, device=DEVICE), torch.zeros(8, dtype=torch.long, device=DEVICE)
    verify_pool, decode_pool = pool.clone(), pool.clone()
    verify = conv_update_triton(x, weight, verify_pool, rows, committed)
    for t in range(spec + 1):
        decode = conv_update_triton(x[:, t : t + 1], weight, decode_pool, rows, committed)
        assert torch.equal(decode[:, 0], verify[:, t]), t
    assert torch.equal(verify_pool[:, :, spec : spec + kernel - 1], decode_pool[:, :, : kernel - 1])


@pytest.mark.parametrize("spec", [1, 3])
def test_gdn_recurrent_verify_equals_decode_steps(spec):
    batch, hk, hv, dk, dv = (8, 16, 16, 128, 128) if REAL else (3, 2, 4, 16, 32)
    length = spec + 1
    q, k = (
        rand(batch, length, hk, dk, dtype=VERIFY_DTYPE, seed=1),
        rand(batch, length, hk, dk, dtype=VERIFY_DTYPE, seed=2),
    )
    v = rand(batch, length, hv, dv, dtype=VERIFY_DTYPE, seed=3)
    a, b = rand(batch, length, hv, dtype=VERIFY_DTYPE, seed=4), rand(batch, length, hv, dtype=VERIFY_DTYPE, seed=5)
    a_log, dt_bias = rand(hv, dtype=VERIFY_DTYPE, seed=6).abs(), rand(hv, dtype=VERIFY_DTYPE, seed=7).abs()
    pool = rand(batch, spec + 1, hv, dk, dv, seed=8, scale=0.1)
    rows, committed = torch.arange(batch, device=DEVICE), torch.zeros(batch, dtype=torch.long, device=DEVICE)
    verify_pool, decode_pool = pool.clone(), pool.clone()
    verify = gdn_recurrent_triton(q, k, v, a, b, a_log, dt_bias, verify_pool, rows, committed)
    for t in range(length):
        step = slice(t, t + 1)
        decode = gdn_recurrent_triton(
            q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], a_log, dt_bias, decode_pool, rows, committed
        )
        assert torch.equal(decode[:, 0], verify[:, t]), t
        assert torch.equal(decode_pool[:, 0], verify_pool[:, t]), t


def test_paged_attention_verify_equals_decode_real_shapes():
    heads, kv_heads, dim, page = (8, 2, 256, 64) if REAL else (4, 2, 32, 8)
    tables = torch.arange(24, dtype=torch.int32, device=DEVICE).reshape(8, 3)
    kv = rand(2, 24, page, kv_heads, dim, dtype=VERIFY_DTYPE, seed=1)
    lens = torch.tensor([5, 9, 3 * page, 17, 2 * page + 1, 3 * page - 1, 3, 2 * page], dtype=torch.int32, device=DEVICE)
    q = rand(8, 3, heads, dim, dtype=VERIFY_DTYPE, seed=2)
    verify = paged_attention_triton(q, kv, tables, lens, dim**-0.5)
    for t in range(3):
        decode = paged_attention_triton(q[:, t : t + 1].contiguous(), kv, tables, lens - 2 + t, dim**-0.5)
        assert torch.equal(decode[:, 0], verify[:, t]), t


def test_prefill_attention_as_accurate_as_sdpa_real_shapes():
    """A 300-token chunk at the end of a 700-token context (27B attention shapes on CUDA, bf16): the tiled
    kernel is no further from an fp32 computation than SDPA over the gathered pages (the CPU path) is."""
    heads, kv_heads, dim, page, length, context = (24, 4, 256, 64, 300, 700) if REAL else (6, 2, 32, 8, 20, 45)
    pages = -(-context // page)
    tables = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).int().to(DEVICE)[None]
    kv = rand(2, pages, page, kv_heads, dim, dtype=VERIFY_DTYPE, seed=1)
    q, lens = rand(1, length, heads, dim, dtype=VERIFY_DTYPE, seed=2), torch.tensor([context], device=DEVICE).int()
    truth = prefill_attention_reference(q.double(), kv.double(), tables, lens, dim**-0.5)
    ours = prefill_attention_triton(q, kv, tables, lens, dim**-0.5)
    sdpa = prefill_attention_reference(q, kv, tables, lens, dim**-0.5)
    ours_err, sdpa_err = ((x.double() - truth).abs().mean().item() for x in (ours, sdpa))
    assert ours_err <= 1.5 * sdpa_err + 1e-12, (ours_err, sdpa_err)


def test_gemm_and_norm_rows_invariant_real_shapes():
    from qwen_mtp.ops.norm import norm_triton

    n, k = (3584, 1024) if REAL else (48, 64)
    weight, x = rand(n, k, dtype=VERIFY_DTYPE, seed=1), rand(40, k, dtype=VERIFY_DTYPE, seed=2)
    full = invariant_matmul_triton(x, weight)
    for rows in (slice(0, 1), slice(3, 11), slice(5, 21)):
        assert torch.equal(invariant_matmul_triton(x[rows], weight), full[rows])
    norm_w = rand(k, dtype=VERIFY_DTYPE, seed=3, scale=0.1)
    normed = norm_triton(x, norm_w, 1e-6)
    for rows in (slice(0, 1), slice(3, 11), slice(5, 21)):
        assert torch.equal(norm_triton(x[rows], norm_w, 1e-6), normed[rows])


def test_custom_ops_pass_opcheck_with_the_models_strided_inputs():
    """Each op's fake (meta) kernel agrees with its real one (shapes, strides, mutation), with inputs as
    non-contiguous as the model hands them over (transposed q/k/v, chunked q): what torch.compile relies on."""
    import qwen_mtp.engine.runner  # noqa: F401  (registers the ops)

    ops = torch.ops.qwen_mtp
    x = rand(2, 3, 8, dtype=torch.float32)
    strided = rand(2, 3, 16, dtype=torch.float32)[..., :8]  # like one half of q_proj's [q | gate] chunk
    w = rand(8, dtype=torch.float32, scale=0.1)
    checks = [
        (ops.rms_norm, (strided, w, 1e-6)),
        (ops.add_rms_norm, (strided, x, w, 1e-6)),
        (ops.swiglu, (rand(2, 3, 16, dtype=torch.float32),)),
        (ops.gated_rms_norm, (strided, x, w, 1e-6)),
        (ops.invariant_linear, (strided, rand(5, 8, dtype=torch.float32))),
    ]
    q, kv, tables, lens = _paged_setup(2, torch.float32)
    kvh, dim = kv.shape[3], kv.shape[4]
    k_new = rand(q.shape[0], kvh, 2, dim, dtype=torch.float32).transpose(1, 2)  # [B, T, KV, D], transposed
    positions = (lens - 2)[:, None].long() + torch.arange(2, device=DEVICE)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, T, H, D] as a transposed view
    checks.append((ops.paged_attention, (q_t, k_new, k_new.clone(), kv, tables, lens, positions, dim**-0.5)))
    checks.append((ops.paged_prefill_attention, (q_t, k_new, k_new.clone(), kv, tables, lens, positions, dim**-0.5)))
    q_gate, k_proj = _fused_projection(2, 3, [2 * 4 * 16, 2 * 16])
    q_half, k_heads = q_gate.reshape(2, 3, 4, 32)[..., :16], k_proj.reshape(2, 3, 2, 16)
    cos, sin = rand(2, 3, 8, seed=9), rand(2, 3, 8, seed=10)
    checks.append((ops.qk_norm_rope, (q_half, k_heads, rand(16, scale=0.1), rand(16, scale=0.1), 1e-6, cos, sin)))
    # prefill q, k, v: slices of one conv output
    gq, gk, gv = (t.view(1, 5, -1, 8) for t in _fused_projection(1, 5, [16, 16, 32], seed=11))
    decay, beta = -rand(1, 5, 4, seed=12).abs(), rand(1, 5, 4, seed=13).sigmoid()
    for initial in (None, rand(1, 4, 8, 8, seed=14)):
        checks.append((ops.gdn_chunked, (gq, gk, gv, decay, beta, initial)))
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        outputs = op(*args)
        for out in outputs if isinstance(outputs, tuple) else (outputs,):
            assert out.is_contiguous()  # the fakes promise contiguous outputs on every device


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_add_then_norm_bitwise(dtype):
    """The fused residual add + norm is the separate add and norm, bit for bit, and batch-invariant."""
    from qwen_mtp.ops.norm import add_rms_norm_reference, norm_triton

    x, delta = rand(5, 48, dtype=dtype, seed=1), rand(5, 48, dtype=dtype, seed=2)
    weight = rand(48, dtype=dtype, seed=3, scale=0.1)
    normed, summed = norm_triton(x, weight, 1e-6, delta=delta)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, norm_triton(x + delta, weight, 1e-6))
    ref_normed, ref_summed = add_rms_norm_reference(x, delta, weight, 1e-6)
    close(normed, ref_normed, dtype)
    one, _ = norm_triton(x[3:4], weight, 1e-6, delta=delta[3:4])
    assert torch.equal(one, normed[3:4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_reference(dtype):
    from qwen_mtp.ops.swiglu import swiglu_reference, swiglu_triton

    gate_up = rand(2, 3, 2 * 40, dtype=dtype, seed=1)
    ours = swiglu_triton(gate_up)
    assert ours.shape == (2, 3, 40)
    close(ours, swiglu_reference(gate_up), dtype)


def test_gdn_recurrent_takes_strided_slices_of_one_conv_output():
    """The model hands q, k, v over as views of one [B, T, C] conv output: same result as contiguous copies."""
    batch, length, hk, hv, dk, dv = 2, 3, 2, 4, 16, 32
    q, k, v = _fused_projection(batch, length, [hk * dk, hk * dk, hv * dv])
    q, k, v = q.reshape(batch, length, hk, dk), k.reshape(batch, length, hk, dk), v.reshape(batch, length, hv, dv)
    a, b = rand(batch, length, hv, seed=4), rand(batch, length, hv, seed=5)
    a_log, dt_bias = rand(hv, seed=6).abs(), rand(hv, seed=7).abs()
    pool = rand(3, 4, hv, dk, dv, seed=8, scale=0.1)
    rows, committed = torch.tensor([2, 0], device=DEVICE), torch.tensor([1, 0, 3], device=DEVICE)
    strided_pool, copied_pool = pool.clone(), pool.clone()
    strided = gdn_recurrent_triton(q, k, v, a, b, a_log, dt_bias, strided_pool, rows, committed)
    copied = gdn_recurrent_triton(
        q.contiguous(), k.contiguous(), v.contiguous(), a, b, a_log, dt_bias, copied_pool, rows, committed
    )
    assert not q.is_contiguous() and torch.equal(strided, copied) and torch.equal(strided_pool, copied_pool)


def _fused_projection(batch, length, sizes, dtype=torch.float32, seed=1):
    """Slices of one [B, T, sum(sizes)] projection output, as the fused GEMMs hand them to the ops."""
    return torch.split(rand(batch, length, sum(sizes), dtype=dtype, seed=seed), sizes, dim=-1)


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_reference_on_strided_slices(length, dtype):
    """The attention layer's head norms + partial rotary in one kernel: equal to the torch composition, reading
    q (every other head_dim block of the q/gate projection) and k in place, and batch-invariant."""
    from qwen_mtp.model.layers import RotaryEmbedding
    from qwen_mtp.ops.rope import qk_norm_rope_reference, qk_norm_rope_triton

    batch, heads, kv_heads, dim, rd = 3, 4, 2, 32, 8
    q_gate, k, _ = _fused_projection(batch, length, [2 * heads * dim, kv_heads * dim, kv_heads * dim], dtype)
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
    from qwen_mtp.model.layers import RotaryEmbedding
    from qwen_mtp.ops.norm import norm_triton
    from qwen_mtp.ops.rope import qk_norm_rope_triton, rotate

    batch, length, heads, kv_heads, dim, rd = 2, 5, 4, 2, 64, 16
    q = rand(batch, length, heads, 2 * dim, dtype=dtype, seed=1)[..., :dim]
    k = rand(batch, length, kv_heads, dim, dtype=dtype, seed=2)
    q_w, k_w = rand(dim, dtype=dtype, seed=3, scale=0.1), rand(dim, dtype=dtype, seed=4, scale=0.1)
    positions = torch.arange(length, device=DEVICE) + torch.tensor([[3], [5000]], device=DEVICE)
    cos, sin = RotaryEmbedding(rd, 1e7).to(DEVICE)(positions, dtype)
    fused = qk_norm_rope_triton(q, k, q_w, k_w, 1e-6, cos, sin)
    for ours, x, w in zip(fused, (q, k), (q_w, k_w), strict=True):
        assert torch.equal(ours, rotate(norm_triton(x, w, 1e-6), cos.unsqueeze(2), sin.unsqueeze(2)))


def test_write_kv_kernel_equals_indexed_write():
    from qwen_mtp.ops.paged_attention import write_kv_triton

    kv = rand(2, 12, 8, 2, 32, seed=1)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([[6, 7, 8], [0, 1, 2]], device=DEVICE)
    _, k, v = _fused_projection(2, 3, [16, 64, 64], seed=2)
    k, v = k.reshape(2, 3, 2, 32), v.reshape(2, 3, 2, 32)  # strided slices
    ref, ours = kv.clone(), kv.clone()
    write_kv(k, v, ref, tables, positions)
    write_kv_triton(k, v, ours, tables, positions)
    assert torch.equal(ours, ref) and not torch.equal(ours, kv)


def test_gated_norm_and_conv_read_strided_projection_slices():
    """The GDN's z (per-head rows of a wider projection row) and qkv slices go into the kernels in place."""
    from qwen_mtp.ops.norm import norm_triton

    x = rand(2, 3, 4, 16, seed=1)
    z, qkv, _ = _fused_projection(2, 3, [64, 40, 8], seed=2)
    z = z.reshape(2, 3, 4, 16)
    weight = rand(16, seed=3, scale=0.1)
    assert torch.equal(norm_triton(x, weight, 1e-6, z), norm_triton(x, weight, 1e-6, z.contiguous()))
    conv_w = rand(40, 4, seed=4)
    pool = rand(3, 40, 7, seed=5)
    rows, committed = torch.tensor([2, 0], device=DEVICE), torch.tensor([1, 0, 2], device=DEVICE)
    strided_pool, copied_pool = pool.clone(), pool.clone()
    strided = conv_update_triton(qkv, conv_w, strided_pool, rows, committed)
    copied = conv_update_triton(qkv.contiguous(), conv_w, copied_pool, rows, committed)
    assert not qkv.is_contiguous() and torch.equal(strided, copied) and torch.equal(strided_pool, copied_pool)


@pytest.mark.parametrize("length,with_state", [(1, False), (37, True), (64, False), (130, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_chunked_prefill_matches_reference(length, with_state, dtype):
    """The prefill kernels (own chunking: prepare + scan) against the torch chunked form, with GVA, ragged last
    chunks, an initial state, and q/k/v as strided slices of one conv output (as the model passes them)."""
    batch, hk, hv, dk, dv = 2, 2, 4, 16, 32
    q, k, v = _fused_projection(batch, length, [hk * dk, hk * dk, hv * dv], dtype)
    q, k, v = q.view(batch, length, hk, dk), k.view(batch, length, hk, dk), v.view(batch, length, hv, dv)
    g, beta = gate_values(rand(batch, length, hv, seed=2), rand(batch, length, hv, dtype=dtype, seed=3),
                          rand(hv, seed=4).abs(), rand(hv, seed=5).abs())  # fmt: skip
    state = rand(batch, hv, dk, dv, seed=6, scale=0.1) if with_state else None
    out, final = gdn_chunked_triton(q, k, v, g, beta, state)
    ref_out, ref_final = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    assert out.dtype == ref_out.dtype and final.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(final, ref_final, rtol=2e-5, atol=2e-5)
