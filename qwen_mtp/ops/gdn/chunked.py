"""Chunked gated delta rule for prefill: Triton kernels beside their plain-torch references, as the custom ops
`qwen_mtp::gdn_chunked` (a batch of equal-length sequences) and `qwen_mtp::gdn_chunked_varlen` (sequences of any
lengths packed back to back, with `cu_seqlens`).

Why our own kernels: the torch form runs ~100 small launches per layer and chunk; flash-linear-attention has such
kernels, but autotunes their tile sizes per process (two processes could round a prompt differently) and keeps
its intermediates in bf16. Ours use fixed tiles and fp32 throughout, so a sequence's numbers depend on nothing but
the sequence (and the engine's prefill chunk boundaries): not on the batch, the packing or the process.

The math, per value head and chunk of C = 64 tokens (kn, qn: the l2-normalised keys and scaled queries;
G = in-chunk cumulative log decay, S = the state at the chunk's start), the WY / UT form:
    A[i, j] = beta_i (kn_i . kn_j) exp(G_i - G_j) for j < i;   T = (I + A)^-1   (unit lower triangular)
    W = T (beta exp(G) kn),  U = T (beta v)             -> the chunk's corrected values: delta = U - W S
    S_next = exp(G_C) S + sum_j exp(G_C - G_j) kn_j delta_j^T
    o_i = exp(G_i) qn_i S + sum_{j <= i} exp(G_i - G_j) (qn_i . kn_j) delta_j
Five kernels, only the fourth sequential:
1. `decay_kkt`, every chunk at once: G, A, and the key factors kn_j exp(G_C - G_j) / k_j;
2. `invert`: T by blocks: its four 16x16 diagonal blocks by forward substitution (15 steps, run side by side),
   then the blocks below them from those (T21 = -T22 A21 T11, ...: 16 tensor-core products of 16x16 tiles);
3. `wy`: W and U (two products per chunk);
4. `states`: the state across chunks, one program per (sequence, value head, block of value columns), two
   products per chunk; it stores each chunk's starting state and delta;
5. `output`: every chunk's output from its starting state and delta, all chunks at once.
Keys and queries are l2-normalised as factors on the rows of the raw inputs, so each product with a raw bf16 input
runs on bf16 tensor cores exactly (`triton_helpers.precise_dot`: q.k and k.k as they are, raw x fp32 as three
exact products with the fp32 side split in bf16 pieces); products of two computed fp32 values use `tf32x3` (three
TF32 products, ~fp32 accuracy): plain TF32 (10 mantissa bits) would move the bf16 outputs away from the
reference's. Everything between the products is fp32.
`chunk_stages` below is each kernel's plain-torch reference, for one sequence, in the kernels' layout.
Measured (H200, 27B shapes): benchmarks/gdn_prefill.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.gdn.naive import _prepare, chunked_gated_delta_rule, chunked_gated_delta_rule_varlen

# Tokens per chunk (`invert` is written for four 16x16 diagonal blocks): fixed, so a prompt's rounding never depends
# on the launch.
CHUNK = 64
DOTS = "tf32x3"  # the GPU dots' precision for fp32 operands (the module docstring says why)
# Value columns per `states` program: it runs sequences x heads x dv / STATE_BLOCK_V programs. 64: with 32 the
# kernel Triton 3.6 builds for the H200 makes an illegal memory access at 8192 tokens (benchmarks/gdn_fault.py;
# its index arithmetic stays in bounds, tests/ops/test_gdn_bounds.py), with 64 it runs and matches the reference.
STATE_BLOCK_V = 64
OUTPUT_BLOCK_V = 64  # value columns per `output` program
PREPARE_WARPS, STATE_WARPS, OUTPUT_WARPS = 4, 4, 8
# `output` with 8 warps on 16-wide tiles (head size 16, the tiny test fixtures') makes an illegal memory access on
# the H200 (Triton 3.6; benchmarks/gdn_fault.py with GDN_SHAPE=2,4,16: only OUTPUT_WARPS = 4 ran), though its
# index arithmetic stays in bounds (tests/ops/test_gdn_bounds.py): below 32 columns it runs with this many warps.
SMALL_TILE_WARPS = 4
INVERT_WARPS = 1  # `invert`'s 16x16 tiles: one warp reduces them without barriers
STATE_STAGES = 2  # software-pipelining depth of the `states` loop (its loads of the next chunk)


@functools.cache  # build (and let Triton cache) the kernels once, on first use
def _kernels():
    import triton
    import triton.language as tl

    # Scratch is chunk-major, [chunks, value heads, C, .]: `base` = (chunk * HV + head) * C is the chunk's first row.

    @triton.jit(do_not_specialize=["N"])
    def decay_kkt(
        k_ptr, g_ptr, beta_ptr, cu_ptr, a_ptr, cum_ptr, kf_ptr, N, HV, GROUP, s_kt, s_kh, s_gt,
        C: tl.constexpr, DK: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one (value head, chunk). G (padded rows add 0: the last row holds the chunk's total), A, and
        # kf = |k|^-1 exp(G_C - G) (kn exp(G_C - G) = k * kf, what `states` folds into delta).
        triton_utils.wait_for_previous_kernel(PDL)
        h = tl.program_id(0)
        chunk = tl.program_id(1)
        first, end = triton_utils.packed_chunk(cu_ptr, N, chunk, C)
        rows = tl.arange(0, C)
        ts = (first + rows).to(tl.int64)
        mask = ts < end
        ks = tl.arange(0, DK)
        k = tl.load(k_ptr + ts[:, None] * s_kt + (h // GROUP) * s_kh + ks[None, :], mask=mask[:, None], other=0.0)
        g = tl.load(g_ptr + ts * s_gt + h, mask=mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + ts * s_gt + h, mask=mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)
        last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)
        k32 = k.to(tl.float32)
        rk = tl.rsqrt(tl.sum(k32 * k32, axis=1) + 1e-6)
        below = rows[None, :] < rows[:, None]
        decay = tl.exp(tl.where(below, cum[:, None] - cum[None, :], float("-inf")))
        kk = triton_utils.precise_dot(k, tl.trans(k), INTERPRETED, PRECISION)  # raw keys: 16-bit products are exact
        a = kk * (beta * rk)[:, None] * rk[None, :] * decay
        base = (chunk.to(tl.int64) * HV + h) * C
        tl.store(a_ptr + (base + rows)[:, None] * C + rows[None, :], a)
        tl.store(cum_ptr + base + rows, cum)
        tl.store(kf_ptr + base + rows, rk * tl.exp(last - cum))

    @triton.jit
    def invert(
        a_ptr, t_ptr, HV, C: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False
    ):  # fmt: skip
        # One program: one (value head, chunk): T = (I + A)^-1 by 16x16 blocks (C = 64: four diagonal blocks);
        # writes T's blocks on and below the diagonal (`wy` reads the rest as zeros).
        triton_utils.wait_for_previous_kernel(PDL)
        h = tl.program_id(0)
        chunk = tl.program_id(1)
        base = (chunk.to(tl.int64) * HV + h) * C
        r = tl.arange(0, 16)
        eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        # The diagonal blocks by forward substitution, four independent chains: row i of a block's inverse is
        # e_i - sum_{j < i} A[i, j] (row j of the inverse), its rows j < i being final already. Each block of A is
        # held transposed, so that its row i comes out of a reduction already laid out as the inverse's rows.
        diagonal = (base + r[None, :]) * C + r[:, None]  # [j, i] -> A[i, j] of the top-left block
        at1 = tl.load(a_ptr + diagonal)
        at2 = tl.load(a_ptr + diagonal + 16 * C + 16)
        at3 = tl.load(a_ptr + diagonal + 32 * C + 32)
        at4 = tl.load(a_ptr + diagonal + 48 * C + 48)
        d1, d2, d3, d4 = eye, eye, eye, eye
        for i in range(1, 16):
            now = r == i
            unit = tl.where(now, 1.0, 0.0)
            a1 = tl.sum(tl.where(now[None, :], at1, 0.0), axis=1)  # [j]: A[i, j], zero for j >= i
            a2 = tl.sum(tl.where(now[None, :], at2, 0.0), axis=1)
            a3 = tl.sum(tl.where(now[None, :], at3, 0.0), axis=1)
            a4 = tl.sum(tl.where(now[None, :], at4, 0.0), axis=1)
            d1 = tl.where(now[:, None], (unit - tl.sum(a1[:, None] * d1, axis=0))[None, :], d1)
            d2 = tl.where(now[:, None], (unit - tl.sum(a2[:, None] * d2, axis=0))[None, :], d2)
            d3 = tl.where(now[:, None], (unit - tl.sum(a3[:, None] * d3, axis=0))[None, :], d3)
            d4 = tl.where(now[:, None], (unit - tl.sum(a4[:, None] * d4, axis=0))[None, :], d4)
        block = (base + r)[:, None] * C + r[None, :]  # the top-left 16x16 block; + 16 * (C * row + column) moves
        a21 = tl.load(a_ptr + block + 16 * C)
        a31 = tl.load(a_ptr + block + 32 * C)
        a32 = tl.load(a_ptr + block + 32 * C + 16)
        a41 = tl.load(a_ptr + block + 48 * C)
        a42 = tl.load(a_ptr + block + 48 * C + 16)
        a43 = tl.load(a_ptr + block + 48 * C + 32)
        # Block forward substitution: T_bc = -T_bb sum_{c <= m < b} A_bm T_mc.
        t21 = -triton_utils.dot(d2, triton_utils.dot(a21, d1, INTERPRETED, PRECISION), INTERPRETED, PRECISION)
        t32 = -triton_utils.dot(d3, triton_utils.dot(a32, d2, INTERPRETED, PRECISION), INTERPRETED, PRECISION)
        t43 = -triton_utils.dot(d4, triton_utils.dot(a43, d3, INTERPRETED, PRECISION), INTERPRETED, PRECISION)
        s31 = triton_utils.dot(a31, d1, INTERPRETED, PRECISION) + triton_utils.dot(a32, t21, INTERPRETED, PRECISION)
        t31 = -triton_utils.dot(d3, s31, INTERPRETED, PRECISION)
        s42 = triton_utils.dot(a42, d2, INTERPRETED, PRECISION) + triton_utils.dot(a43, t32, INTERPRETED, PRECISION)
        t42 = -triton_utils.dot(d4, s42, INTERPRETED, PRECISION)
        s41 = triton_utils.dot(a41, d1, INTERPRETED, PRECISION) + triton_utils.dot(a42, t21, INTERPRETED, PRECISION)
        s41 += triton_utils.dot(a43, t31, INTERPRETED, PRECISION)
        t41 = -triton_utils.dot(d4, s41, INTERPRETED, PRECISION)
        tl.store(t_ptr + block, d1)
        tl.store(t_ptr + block + 16 * C, t21)
        tl.store(t_ptr + block + 16 * C + 16, d2)
        tl.store(t_ptr + block + 32 * C, t31)
        tl.store(t_ptr + block + 32 * C + 16, t32)
        tl.store(t_ptr + block + 32 * C + 32, d3)
        tl.store(t_ptr + block + 48 * C, t41)
        tl.store(t_ptr + block + 48 * C + 16, t42)
        tl.store(t_ptr + block + 48 * C + 32, t43)
        tl.store(t_ptr + block + 48 * C + 48, d4)

    @triton.jit(do_not_specialize=["N"])
    def wy(
        k_ptr, v_ptr, beta_ptr, cu_ptr, t_ptr, cum_ptr, w_ptr, u_ptr, N, HV, GROUP, s_kt, s_kh, s_vt, s_vh, s_gt,
        C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one (value head, chunk): W = T (beta exp(G) kn), U = T (beta v), the row factors applied to
        # T's columns.
        triton_utils.wait_for_previous_kernel(PDL)
        h = tl.program_id(0)
        chunk = tl.program_id(1)
        first, end = triton_utils.packed_chunk(cu_ptr, N, chunk, C)
        rows = tl.arange(0, C)
        ts = (first + rows).to(tl.int64)
        mask = ts < end
        ks = tl.arange(0, DK)
        vs = tl.arange(0, DV)
        k = tl.load(k_ptr + ts[:, None] * s_kt + (h // GROUP) * s_kh + ks[None, :], mask=mask[:, None], other=0.0)
        v = tl.load(v_ptr + ts[:, None] * s_vt + h * s_vh + vs[None, :], mask=mask[:, None], other=0.0)
        beta = tl.load(beta_ptr + ts * s_gt + h, mask=mask, other=0.0).to(tl.float32)
        base = (chunk.to(tl.int64) * HV + h) * C
        cum = tl.load(cum_ptr + base + rows)
        k32 = k.to(tl.float32)
        rk = tl.rsqrt(tl.sum(k32 * k32, axis=1) + 1e-6)
        on_or_below = rows[None, :] // 16 <= rows[:, None] // 16
        inverse = tl.load(t_ptr + (base + rows)[:, None] * C + rows[None, :], mask=on_or_below, other=0.0)
        w = triton_utils.precise_dot(inverse * (beta * tl.exp(cum) * rk)[None, :], k, INTERPRETED, PRECISION)
        u = triton_utils.precise_dot(inverse * beta[None, :], v, INTERPRETED, PRECISION)
        tl.store(w_ptr + (base + rows)[:, None] * DK + ks[None, :], w)
        tl.store(u_ptr + (base + rows)[:, None] * DV + vs[None, :], u)

    @triton.jit(do_not_specialize=["N"])
    def states(
        k_ptr, cu_ptr, w_ptr, u_ptr, cum_ptr, kf_ptr, init_ptr, h_ptr, delta_ptr, final_ptr, N, HV, GROUP, s_kt,
        s_kh, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, HAS_INIT: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one (sequence, value head, BLOCK_V value columns), its chunks in order; the state tile
        # [DK, BLOCK_V] stays in registers. Per chunk: store S; delta = U - W S; S = exp(G_C) S + k^T (kf delta).
        triton_utils.wait_for_previous_kernel(PDL)
        pid = tl.program_id(0)
        n = pid // HV
        h = pid % HV
        bos = tl.load(cu_ptr + n)
        eos = tl.load(cu_ptr + n + 1)
        before = n * 0
        for s in range(n):  # the chunks of the sequences before this one
            before += (tl.load(cu_ptr + s + 1) - tl.load(cu_ptr + s) + C - 1) // C
        ks = tl.arange(0, DK)
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        rows = tl.arange(0, C)
        tile = (n.to(tl.int64) * HV + h) * DK * DV + ks[:, None] * DV + vs[None, :]
        if HAS_INIT:
            state = tl.load(init_ptr + tile).to(tl.float32)
        else:
            state = tl.zeros([DK, BLOCK_V], dtype=tl.float32)
        # Offsets inside a chunk's tiles (int32, the same every step) from per-chunk scalar bases (int64)
        h_tile = ks[:, None] * DV + vs[None, :]
        w_tile = rows[:, None] * DK + ks[None, :]
        u_tile = rows[:, None] * DV + vs[None, :]
        k_tile = rows[None, :] * s_kt + ks[:, None]  # [DK, C]: the chunk's keys, transposed
        k_head = k_ptr + (h // GROUP) * s_kh
        for c in range((eos - bos + C - 1) // C):
            head = (before + c).to(tl.int64) * HV + h
            base = head * C
            tl.store(h_ptr + head * DK * DV + h_tile, state)
            w = tl.load(w_ptr + base * DK + w_tile)
            u = tl.load(u_ptr + base * DV + u_tile)
            delta = u - triton_utils.dot(w, state, INTERPRETED, PRECISION)
            tl.store(delta_ptr + base * DV + u_tile, delta)
            start = bos + c * C
            k_t = tl.load(k_head + start.to(tl.int64) * s_kt + k_tile, mask=(start + rows < eos)[None, :], other=0.0)
            kf = tl.load(kf_ptr + base + rows)
            last = tl.load(cum_ptr + base + C - 1)
            update = triton_utils.precise_dot(k_t, delta * kf[:, None], INTERPRETED, PRECISION)
            state = state * tl.exp(last) + update
        tl.store(final_ptr + tile, state)

    @triton.jit(do_not_specialize=["N"])
    def output(
        q_ptr, k_ptr, cu_ptr, cum_ptr, h_ptr, delta_ptr, out_ptr, N, HV, GROUP, scale, s_qt, s_qh, s_ot, s_oh,
        C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRETED: tl.constexpr,
        PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one (value head, chunk, BLOCK_V value columns): o = exp(G) qn S + (causal qn kn^T decay) delta.
        # q and k share strides (slices of one conv output).
        triton_utils.wait_for_previous_kernel(PDL)
        h = tl.program_id(0)
        chunk = tl.program_id(1)
        first, end = triton_utils.packed_chunk(cu_ptr, N, chunk, C)
        rows = tl.arange(0, C)
        ts = (first + rows).to(tl.int64)
        mask = ts < end
        ks = tl.arange(0, DK)
        vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        qk_offsets = ts[:, None] * s_qt + (h // GROUP) * s_qh + ks[None, :]
        q = tl.load(q_ptr + qk_offsets, mask=mask[:, None], other=0.0)
        k = tl.load(k_ptr + qk_offsets, mask=mask[:, None], other=0.0)
        q32, k32 = q.to(tl.float32), k.to(tl.float32)
        rq = tl.rsqrt(tl.sum(q32 * q32, axis=1) + 1e-6) * scale
        rk = tl.rsqrt(tl.sum(k32 * k32, axis=1) + 1e-6)
        head = chunk.to(tl.int64) * HV + h
        cum = tl.load(cum_ptr + head * C + rows)
        causal = rows[None, :] <= rows[:, None]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        qk = triton_utils.precise_dot(q, tl.trans(k), INTERPRETED, PRECISION)  # raw: 16-bit products are exact
        scores = qk * rq[:, None] * rk[None, :] * decay
        state = tl.load(h_ptr + head * DK * DV + ks[:, None] * DV + vs[None, :])
        delta = tl.load(delta_ptr + (head * C + rows)[:, None] * DV + vs[None, :])
        out = triton_utils.precise_dot(q, state, INTERPRETED, PRECISION) * (rq * tl.exp(cum))[:, None]
        out += triton_utils.dot(scores, delta, INTERPRETED, PRECISION)
        tl.store(
            out_ptr + ts[:, None] * s_ot + h * s_oh + vs[None, :], out.to(out_ptr.dtype.element_ty), mask=mask[:, None]
        )

    return decay_kkt, invert, wy, states, output


def supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels take these head sizes: powers of two of at least 16 (`tl.dot`'s smallest tile)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (q.shape[-1], v.shape[-1]))


def _packed_chunks(length: int, sequences: int) -> int:
    """Chunk slots for `sequences` packed sequences of `length` tokens in all, whatever their lengths: a sequence
    of l tokens takes ceil(l / C), and the ceilings add at most one chunk per sequence after the first."""
    return -(-length // CHUNK) + sequences - 1


def _launch(q, k, v, g, beta, cu_seqlens, chunks, initial_state):
    """The five kernels over packed sequences: q, k [T, Hk, dk] (same strides), v [T, Hv, dv], g, beta [T, Hv]
    (token stride Hv), cu_seqlens [N + 1] int32, `chunks` chunk slots (at least the sequences' chunks), initial
    state [N, Hv, dk, dv] or None. Returns (output [T, Hv, dv], final states [N, Hv, dk, dv] fp32, scratch)."""
    import triton

    decay_kkt, invert, wy, states, output = _kernels()
    length, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    sequences = cu_seqlens.shape[0] - 1
    group = hv // hk

    def scratch(*shape):
        return torch.empty(chunks, hv, *shape, dtype=torch.float32, device=q.device)

    a, inverse, cum, kf = scratch(CHUNK, CHUNK), scratch(CHUNK, CHUNK), scratch(CHUNK), scratch(CHUNK)
    w, u, delta, starts = scratch(CHUNK, dk), scratch(CHUNK, dv), scratch(CHUNK, dv), scratch(dk, dv)
    out = torch.empty(length, hv, dv, dtype=q.dtype, device=q.device)
    final = torch.empty(sequences, hv, dk, dv, dtype=torch.float32, device=q.device)
    init = final if initial_state is None else initial_state.float().contiguous()
    common = dict(INTERPRETED=triton_utils.INTERPRET, PRECISION=DOTS, **triton_utils.launch(q.device))
    decay_kkt[(hv, chunks)](
        k, g, beta, cu_seqlens, a, cum, kf, sequences, hv, group, k.stride(0), k.stride(1), g.stride(0),
        C=CHUNK, DK=dk, num_warps=PREPARE_WARPS, **common,
    )  # fmt: skip
    invert[(hv, chunks)](a, inverse, hv, C=CHUNK, num_warps=INVERT_WARPS, **common)
    wy[(hv, chunks)](
        k, v, beta, cu_seqlens, inverse, cum, w, u, sequences, hv, group, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), g.stride(0), C=CHUNK, DK=dk, DV=dv, num_warps=PREPARE_WARPS, **common,
    )  # fmt: skip
    block_v = min(dv, STATE_BLOCK_V)
    states[(sequences * hv, triton.cdiv(dv, block_v))](
        k, cu_seqlens, w, u, cum, kf, init, starts, delta, final, sequences, hv, group, k.stride(0), k.stride(1),
        C=CHUNK, DK=dk, DV=dv, BLOCK_V=block_v, HAS_INIT=initial_state is not None, num_warps=STATE_WARPS,
        num_stages=STATE_STAGES, **common,
    )  # fmt: skip
    block_v = min(dv, OUTPUT_BLOCK_V)
    output_warps = OUTPUT_WARPS if min(dk, block_v) >= 32 else SMALL_TILE_WARPS
    output[(hv, chunks, triton.cdiv(dv, block_v))](
        q, k, cu_seqlens, cum, starts, delta, out, sequences, hv, group, dk**-0.5, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), C=CHUNK, DK=dk, DV=dv, BLOCK_V=block_v, num_warps=output_warps, **common,
    )  # fmt: skip
    parts = dict(a=a, inverse=inverse, cum=cum, kf=kf, w=w, u=u, states=starts, delta=delta)
    return out, final, parts


def _tokens_first(*tensors):
    """Views with unit last stride, q and k with equal strides, g and beta contiguous (what `_launch` takes)."""
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in tensors)
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    return q, k, v, g.contiguous(), beta.contiguous()


def gdn_chunked_triton(q, k, v, g, beta, initial_state=None):
    """Triton version of `chunked_gated_delta_rule` (q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv];
    initial_state [B, Hv, dk, dv] or None). Returns (output [B, T, Hv, dv] in q's dtype, final state fp32). The B
    sequences run as B packed ones: each one's numbers are those of a call with it alone."""
    batch, length = q.shape[:2]
    q, k, v, g, beta = _tokens_first(q, k, v, g, beta)
    # [B, T, ...] as [B * T, ...]: a view where the batch stride is T token strides, a copy otherwise
    q, k, v = (t.view(batch * length, *t.shape[2:]) if t.stride(0) == length * t.stride(1) or batch == 1
               else t.reshape(batch * length, *t.shape[2:]) for t in (q, k, v))  # fmt: skip
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=q.device)
    chunks = batch * -(-length // CHUNK)
    out, final, _ = _launch(q, k, v, g.view(-1, g.shape[-1]), beta.view(-1, beta.shape[-1]), cu, chunks, initial_state)
    return out.view(batch, length, *out.shape[1:]), final


def gdn_chunked_varlen_triton(q, k, v, g, beta, cu_seqlens, initial_state=None):
    """`gdn_chunked_triton` over N sequences packed back to back (q, k [1, T, Hk, dk]; v [1, T, Hv, dv]; g, beta
    [1, T, Hv]; cu_seqlens [N + 1]: their cumulative lengths, on the device; initial_state [N, Hv, dk, dv] or None).
    Returns (output [1, T, Hv, dv], final states [N, Hv, dk, dv] fp32); each sequence's are bitwise those of a call
    with it alone. Reads nothing back to the host."""
    q, k, v, g, beta = _tokens_first(*(t[0] for t in (q, k, v, g, beta)))
    cu = cu_seqlens.to(torch.int32)
    chunks = _packed_chunks(q.shape[0], cu.shape[0] - 1)
    out, final, _ = _launch(q, k, v, g, beta, cu, chunks, initial_state)
    return out[None], final


def chunk_stages(q, k, v, g, beta, initial_state=None) -> dict[str, torch.Tensor]:
    """Plain-torch reference of each kernel, for one sequence (q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv];
    initial_state [Hv, dk, dv] or None): the quantities the kernels leave in their scratch ([chunks, Hv, C, .];
    `states`: each chunk's starting state [chunks, Hv, dk, dv]) and their results (`out` [T, Hv, dv] fp32, `final`
    [Hv, dk, dv]). The math is `naive.chunked_gated_delta_rule`'s, with its quantities named as the kernels'."""
    length = q.shape[0]
    q, k, v, g, beta = (x[0] for x in _prepare(*(t[None] for t in (q, k, v, g, beta))))  # [Hv, T, .], fp32
    q = q * q.shape[-1] ** -0.5
    pad = -length % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // CHUNK

    def by_chunk(x):  # [Hv, T, ...] -> [chunks, Hv, C, ...]
        return x.reshape(x.shape[0], chunks, CHUNK, *x.shape[2:]).transpose(0, 1)

    q, k, v, g, beta = (by_chunk(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)
    below = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    pair = cum[..., :, None] - cum[..., None, :]
    a = beta[..., None] * (k @ k.transpose(-1, -2)) * pair.masked_fill(~below, float("-inf")).exp()
    eye = torch.eye(CHUNK, dtype=a.dtype, device=a.device)
    inverse = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    w = inverse @ (k * (beta * cum.exp())[..., None])
    u = inverse @ (v * beta[..., None])
    kf = (cum[..., -1:] - cum).exp()  # times 1 / |k| in the kernel, which multiplies the raw keys
    state = torch.zeros(k.shape[1], k.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device)
    if initial_state is not None:
        state = initial_state.to(v.dtype)
    starts, deltas = [], []
    for c in range(chunks):
        starts.append(state)
        deltas.append(u[c] - w[c] @ state)
        state = state * cum[c, :, -1, None, None].exp() + (k[c] * kf[c, ..., None]).transpose(-1, -2) @ deltas[-1]
    starts, delta = torch.stack(starts), torch.stack(deltas)
    scores = (q @ k.transpose(-1, -2)) * pair.masked_fill(~causal, float("-inf")).exp()
    out = (q * cum.exp()[..., None]) @ starts + scores @ delta
    out = out.transpose(1, 2).reshape(chunks * CHUNK, out.shape[1], out.shape[-1])[:length]
    return dict(a=a, inverse=inverse, cum=cum, w=w, u=u, states=starts, delta=delta, out=out, final=state)


@torch.library.custom_op("qwen_mtp::gdn_chunked", mutates_args=())
def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: `chunked_gated_delta_rule` on CPU (bit for bit Hugging Face's), the Triton kernels on CUDA."""
    return chunked_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state)


@cuda_kernel(gdn_chunked)
def _(q, k, v, g, beta, initial_state):
    if reference_forced("gdn_chunked") or not supported(q, v):
        return chunked_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state)
    return gdn_chunked_triton(q, k, v, g, beta, initial_state)


@gdn_chunked.register_fake
def _(q, k, v, g, beta, initial_state):
    batch, dk = q.shape[0], q.shape[-1]
    state_dtype = torch.promote_types(q.dtype, torch.float32)
    return v.new_empty(v.shape, dtype=q.dtype), v.new_empty(batch, v.shape[2], dk, v.shape[3], dtype=state_dtype)


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)


def _gdn_chunked_reference(q, k, v, g, beta, initial_state):
    return chunked_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state)


register_reference_autograd(gdn_chunked, _gdn_chunked_reference)


@torch.library.custom_op("qwen_mtp::gdn_chunked_varlen", mutates_args=())
def gdn_chunked_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: `chunked_gated_delta_rule_varlen` on CPU, the Triton kernels on CUDA (each sequence's results
    bitwise those of `gdn_chunked` on it alone)."""
    return chunked_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, initial_state=initial_state)


@cuda_kernel(gdn_chunked_varlen)
def _(q, k, v, g, beta, cu_seqlens, initial_state):
    if reference_forced("gdn_chunked_varlen") or not supported(q, v):
        return chunked_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, initial_state=initial_state)
    return gdn_chunked_varlen_triton(q, k, v, g, beta, cu_seqlens, initial_state)


@gdn_chunked_varlen.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state):
    state_dtype = torch.promote_types(q.dtype, torch.float32)
    finals = v.new_empty(cu_seqlens.shape[0] - 1, v.shape[2], q.shape[-1], v.shape[3], dtype=state_dtype)
    return v.new_empty(v.shape, dtype=q.dtype), finals


def _gdn_chunked_varlen_reference(q, k, v, g, beta, cu_seqlens, initial_state):
    return chunked_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, initial_state=initial_state)


register_reference_autograd(gdn_chunked_varlen, _gdn_chunked_varlen_reference)
