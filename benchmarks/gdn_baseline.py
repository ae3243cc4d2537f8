"""The GDN prefill kernels as they were before the WY/UT rewrite of `qwen_mtp/ops/gdn/chunked.py` (commit
899697a): `prepare` (a 31-step forward substitution per 32-token chunk) and `scan` (the state and the outputs in
one sequential pass). Kept only as the baseline that benchmarks/gdn_prefill.py times the new kernels against.
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import triton_utils

# Tokens per chunk: fixed, so a prompt's rounding never depends on the launch. 32, not the torch form's 64: at
# head dim 128 the 64-token `prepare` needs 278 KB of shared memory for its dots (the H200 has 227 KB).
CHUNK = 32
DOTS = "tf32x3"  # the GPU dots' precision: ~fp32 accuracy on tensor cores (the module docstring says why)
SCAN_BLOCK_V = 32  # value columns per `scan` program: the sequential pass runs heads x dv / SCAN_BLOCK_V programs
PREPARE_WARPS, SCAN_WARPS = 8, 4


@functools.cache  # build (and let Triton cache) the kernels once, on first use
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "sq_b", "sv_b", "sg_b"])
    def prepare(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, scores_ptr, cum_ptr,
        T, HV, GROUP, scale, sq_b, sq_t, sq_h, sv_b, sv_t, sv_h, sg_b, sg_t,
        C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # One program: one (request, value head, chunk): everything about the chunk that does not need the
        # state, into fp32 scratch [B, HV, T_padded, .] (scores: [B, HV, chunks, C, C]).
        pid = tl.program_id(0)
        bi = pid // HV
        h = pid % HV
        chunk = tl.program_id(1)
        ts = chunk * C + tl.arange(0, C)
        mask = ts < T
        rows = tl.arange(0, C)
        ks = tl.arange(0, DK)
        vs = tl.arange(0, DV)
        qk_offsets = bi * sq_b + (h // GROUP) * sq_h + ts[:, None] * sq_t + ks[None, :]
        q = tl.load(q_ptr + qk_offsets, mask=mask[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offsets, mask=mask[:, None], other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        v_offsets = bi * sv_b + h * sv_h + ts[:, None] * sv_t + vs[None, :]
        v = tl.load(v_ptr + v_offsets, mask=mask[:, None], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + bi * sg_b + ts * sg_t + h, mask=mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + bi * sg_b + ts * sg_t + h, mask=mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)  # padded rows add 0: the last row holds the chunk's total
        last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)
        causal = rows[None, :] <= rows[:, None]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        below = rows[None, :] < rows[:, None]
        a = tl.where(below, triton_utils.dot(k, tl.trans(k), INTERPRETED, PRECISION) * beta[:, None] * decay, 0.0)
        # T = (I + A)^-1 by forward substitution: row i = e_i - sum_{j<i} A[i, j] T[j] (rows j < i are final).
        inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
        for i in range(1, C):
            a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
            step = tl.sum(a_i[:, None] * inverse, axis=0)
            inverse = tl.where(rows[:, None] == i, inverse - step[None, :], inverse)
        w = triton_utils.dot(inverse, k * (beta * tl.exp(cum))[:, None], INTERPRETED, PRECISION)
        u = triton_utils.dot(inverse, v * beta[:, None], INTERPRETED, PRECISION)
        scores = triton_utils.dot(q, tl.trans(k), INTERPRETED, PRECISION) * decay
        head = (bi * HV + h).to(tl.int64)
        scratch = head * tl.num_programs(1) * C + ts
        tl.store(w_ptr + scratch[:, None] * DK + ks[None, :], w)
        tl.store(u_ptr + scratch[:, None] * DV + vs[None, :], u)
        tl.store(qd_ptr + scratch[:, None] * DK + ks[None, :], q * tl.exp(cum)[:, None])
        tl.store(kd_ptr + scratch[:, None] * DK + ks[None, :], k * tl.exp(last - cum)[:, None])
        tl.store(scores_ptr + (scratch[:, None] * C + rows[None, :]), scores)
        tl.store(cum_ptr + scratch, cum)

    @triton.jit(do_not_specialize=["T", "NC", "so_b"])
    def scan(
        w_ptr, u_ptr, qd_ptr, kd_ptr, scores_ptr, cum_ptr, init_ptr, out_ptr, final_ptr,
        T, NC, HV, so_b, so_t, so_h,
        C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, HAS_INIT: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # One program: one (request, value head, BLOCK_V value columns), all chunks in order; the state tile
        # [DK, BLOCK_V] stays in registers. Per chunk: delta = U - W S; out = Qd S + scores delta;
        # S = exp(last) S + Kd^T delta.
        pid = tl.program_id(0)
        bi = pid // HV
        h = pid % HV
        ks = tl.arange(0, DK)
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        rows = tl.arange(0, C)
        head = (bi * HV + h).to(tl.int64)
        tile = head * DK * DV + ks[:, None] * DV + vs[None, :]
        if HAS_INIT:
            state = tl.load(init_ptr + tile).to(tl.float32)
        else:
            state = tl.zeros([DK, BLOCK_V], dtype=tl.float32)
        for c in range(NC):
            ts = c * C + rows
            scratch = head * NC * C + ts
            w = tl.load(w_ptr + scratch[:, None] * DK + ks[None, :])
            u = tl.load(u_ptr + scratch[:, None] * DV + vs[None, :])
            qd = tl.load(qd_ptr + scratch[:, None] * DK + ks[None, :])
            kd = tl.load(kd_ptr + scratch[:, None] * DK + ks[None, :])
            scores = tl.load(scores_ptr + (scratch[:, None] * C + rows[None, :]))
            last = tl.load(cum_ptr + head * NC * C + c * C + C - 1)
            delta = u - triton_utils.dot(w, state, INTERPRETED, PRECISION)
            out = triton_utils.dot(qd, state, INTERPRETED, PRECISION)
            out += triton_utils.dot(scores, delta, INTERPRETED, PRECISION)
            tl.store(
                out_ptr + bi * so_b + ts[:, None] * so_t + h * so_h + vs[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=(ts < T)[:, None],
            )
            state = state * tl.exp(last) + triton_utils.dot(tl.trans(kd), delta, INTERPRETED, PRECISION)
        tl.store(final_ptr + tile, state)

    return prepare, scan


def supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels take these head sizes: powers of two of at least 16 (`tl.dot`'s smallest tile)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (q.shape[-1], v.shape[-1]))


def gdn_chunked_triton(q, k, v, g, beta, initial_state=None):
    """Triton version of `chunked_gated_delta_rule` (q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv];
    initial_state [B, Hv, dk, dv] or None). Returns (output [B, T, Hv, dv] in q's dtype, final state fp32)."""
    import triton

    prepare, scan = _kernels()
    batch, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    chunks = triton.cdiv(length, CHUNK)
    padded = chunks * CHUNK

    def scratch(*shape):
        return torch.empty(batch, hv, *shape, dtype=torch.float32, device=q.device)

    w, u, qd, kd = scratch(padded, dk), scratch(padded, dv), scratch(padded, dk), scratch(padded, dk)
    scores, cum = scratch(padded, CHUNK), scratch(padded)
    out = torch.empty(batch, length, hv, dv, dtype=q.dtype, device=q.device)
    final = torch.empty(batch, hv, dk, dv, dtype=torch.float32, device=q.device)
    init = final if initial_state is None else initial_state.float().contiguous()
    prepare[(batch * hv, chunks)](
        q, k, v, g, beta, w, u, qd, kd, scores, cum,
        length, hv, hv // hk, dk**-0.5, q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1),
        v.stride(2), g.stride(0), g.stride(1),
        C=CHUNK, DK=dk, DV=dv, INTERPRETED=triton_utils.INTERPRET, PRECISION=DOTS, num_warps=PREPARE_WARPS,
    )  # fmt: skip
    block_v = min(dv, SCAN_BLOCK_V)
    scan[(batch * hv, triton.cdiv(dv, block_v))](
        w, u, qd, kd, scores, cum, init, out, final,
        length, chunks, hv, out.stride(0), out.stride(1), out.stride(2),
        C=CHUNK, DK=dk, DV=dv, BLOCK_V=block_v, HAS_INIT=initial_state is not None,
        INTERPRETED=triton_utils.INTERPRET, PRECISION=DOTS, num_warps=SCAN_WARPS,
    )  # fmt: skip
    return out, final
