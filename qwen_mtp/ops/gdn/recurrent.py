"""Decode / verify: the gated delta rule over T = 1..K+1 tokens of each request, starting from and writing to its
rows of the state pool, as the custom op `qwen_mtp::gdn_recurrent` (the plain-torch reference on CPU, a fused
Triton kernel on CUDA: gates + l2norm + recurrence in one launch).

Each request's state after every token lands in its own pool slot, so speculative verify commits an accepted
prefix by index. A position's result never depends on T or on the other requests: MTP-on == MTP-off rests on it.
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.gdn.naive import gate_values, recurrent_gated_delta_rule


def gdn_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803
    dt_bias: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    committed: torch.Tensor,
) -> torch.Tensor:
    """q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; a, b [B, T, Hv]; pool [rows, slots, Hv, dk, dv] (slots >= T).

    Starts each request from `pool[row, committed[row]]`, writes the state after token t into `pool[row, t]`
    and returns the output [B, T, Hv, dv]."""
    g, beta = gate_values(a, b, A_log, dt_bias, invariant=True)
    initial = pool[rows, committed[rows]]
    out, states = recurrent_gated_delta_rule(q, k, v, g, beta, initial, state_dtype=pool.dtype)
    pool[rows, : q.shape[1]] = states.to(pool.dtype)
    return out


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _gdn_recurrent_kernel():
    import triton
    import triton.language as tl

    # One binary for every T and pool size: Triton would otherwise compile T == 1 separately, and two binaries
    # may contract `state * exp(g) + k * delta` into FMAs differently (seen on the H200: decode and verify
    # states differed).
    @triton.jit(do_not_specialize=["T", "sq_b", "sv_b", "sa_b", "so_b", "sp_r"])
    def gdn_recurrent_rows(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, pool_ptr, rows_ptr, committed_ptr, out_ptr,
        T, HV, GROUP, scale,
        sq_b, sq_t, sq_h, sv_b, sv_t, sv_h, sa_b, sa_t,
        sp_r, sp_s, sp_h, so_b, so_t, so_h,
        DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one request, one value head, BLOCK_V value columns, all T tokens in order. The state
        # tile [DK, BLOCK_V] lives in registers (read from the start slot before any slot is written; other
        # programs touch other heads/columns); nothing in it depends on other requests or on T.
        # The state tile, the gates' parameters and the request's row and start slot are read before the wait for
        # the previous kernel (`triton_utils.launch` says why no running kernel can be writing them); the
        # projected inputs q, k, v, a, b after it.
        pid = tl.program_id(0)
        bi = pid // HV
        h = pid % HV
        hk = h // GROUP
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        ks = tl.arange(0, DK)
        vmask = vs < DV
        row = tl.load(rows_ptr + bi)
        start = tl.load(committed_ptr + row)
        tile = ks[:, None] * DV + vs[None, :]
        base = pool_ptr + row * sp_r + h * sp_h
        state = tl.load(base + start * sp_s + tile, mask=vmask[None, :], other=0.0).to(tl.float32)
        decay_rate = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        triton_utils.wait_for_previous_kernel(PDL)
        # Token t + 1's inputs are loaded while token t computes (the last token's twice): a load where it is used
        # made every token wait for its round trip. The loop body, hence every token's arithmetic, is one.
        qk = q_ptr + bi * sq_b + hk * sq_h + ks, k_ptr + bi * sq_b + hk * sq_h + ks
        vab = v_ptr + bi * sv_b + h * sv_h + vs, a_ptr + bi * sa_b + h, b_ptr + bi * sa_b + h
        q_in, k_in = tl.load(qk[0]), tl.load(qk[1])
        v_in, a_in, b_in = tl.load(vab[0], mask=vmask, other=0.0), tl.load(vab[1]), tl.load(vab[2])
        for t in range(T):
            q, k, v, a, b = q_in.to(tl.float32), k_in.to(tl.float32), v_in.to(tl.float32), a_in.to(tl.float32), b_in
            ahead = tl.minimum(t + 1, T - 1)
            q_in, k_in = tl.load(qk[0] + ahead * sq_t), tl.load(qk[1] + ahead * sq_t)
            v_in = tl.load(vab[0] + ahead * sv_t, mask=vmask, other=0.0)
            a_in, b_in = tl.load(vab[1] + ahead * sa_t), tl.load(vab[2] + ahead * sa_t)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            x = a + dt_bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            g = decay_rate * softplus
            beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)  # HF: sigmoid in the activation dtype
            state = state * tl.exp(g)
            kv_mem = tl.sum(state * k[:, None], axis=0)
            delta = (v - kv_mem) * beta
            state = state + k[:, None] * delta[None, :]
            o = tl.sum(state * q[:, None], axis=0)
            tl.store(out_ptr + bi * so_b + t * so_t + h * so_h + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)
            state = state.to(pool_ptr.dtype.element_ty).to(tl.float32)  # the pool's precision, every token
            tl.store(base + t * sp_s + tile, state.to(pool_ptr.dtype.element_ty), mask=vmask[None, :])

    return gdn_recurrent_rows


def gdn_recurrent_triton(q, k, v, a, b, A_log, dt_bias, pool, rows, committed, block_v=None, num_warps=4):  # noqa: N803
    """Triton version of `gdn_recurrent_reference` (same arguments, same in-place pool update). `block_v` and
    `num_warps` (value columns a program, its warps) are for benchmarks/gdn_recurrent.py: they change how the
    dk sums are laid out, hence their rounding, so the engine always runs the defaults."""
    import triton

    batch, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    # q and k (and a and b) share one set of strides in the kernel; views of one conv output already do, so
    # the model's strided q/k/v slices go in without copies.
    q, k, v, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, a, b))
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    if a.stride() != b.stride():
        a, b = a.contiguous(), b.contiguous()
    assert pool.is_contiguous()
    out = v.new_empty(v.shape)  # contiguous, whatever v's strides
    block_v = block_v or min(32, triton.next_power_of_2(dv))
    _gdn_recurrent_kernel()[(batch * hv, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, pool, rows, committed, out,
        length, hv, hv // hk, dk**-0.5,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), out.stride(0), out.stride(1), out.stride(2),
        DK=dk, DV=dv, BLOCK_V=block_v, num_warps=num_warps, **triton_utils.launch(q.device),
    )  # fmt: skip
    return out


@torch.library.custom_op("qwen_mtp::gdn_recurrent", mutates_args=("pool",))
def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803
    dt_bias: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    committed: torch.Tensor,
) -> torch.Tensor:
    """Custom op: `gdn_recurrent_reference` on CPU, the Triton kernel on CUDA."""
    return gdn_recurrent_reference(q, k, v, a, b, A_log, dt_bias, pool, rows, committed).contiguous()


@cuda_kernel(gdn_recurrent)
def _(q, k, v, a, b, A_log, dt_bias, pool, rows, committed):  # noqa: N803
    if reference_forced("gdn_recurrent"):
        return gdn_recurrent_reference(q, k, v, a, b, A_log, dt_bias, pool, rows, committed).contiguous()
    return gdn_recurrent_triton(q, k, v, a, b, A_log, dt_bias, pool, rows, committed)


@gdn_recurrent.register_fake
def _(q, k, v, a, b, A_log, dt_bias, pool, rows, committed):  # noqa: N803
    return v.new_empty(v.shape)  # contiguous, as both implementations return
