"""Gated delta rule (the recurrence inside a Gated DeltaNet layer), in plain PyTorch.

Two equivalent forms, as in Hugging Face and flash-linear-attention:
- `recurrent_gated_delta_rule`: one token at a time; used for decode and speculative verify, where a
  position's result must not depend on how many tokens share the call.
- `chunked_gated_delta_rule`: the chunk-parallel (UT transform) form used for prefill; it equals the recurrent
  form up to fp32 rounding (~1e-7).

Math per value head, state S in R^{dk x dv}, in fp32:
    q, k <- l2norm(q), l2norm(k);  q <- q * dk^-0.5
    S <- exp(g_t) * S;  delta = beta_t * (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
Shapes: q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; state [B, Hv, dk, dv] (fp32; fp64 when the
inputs are fp64, which tests use to separate rounding from bugs).
The operation order follows Hugging Face's torch path so CPU results match it bit for bit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """Expand key heads to value heads (GVA), move heads first, upcast, l2-normalise and scale q."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for reference checks
    q, k, v, beta, g = [
        x.transpose(1, 2).to(compute, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)
    ]
    q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule. Returns (output [B, T, Hv, dv] in q's dtype, the state after *every* token
    [B, T, Hv, dk, dv]).

    The per-token states are what speculative verify commits from: the state after an accepted prefix is
    selected by index, never recomputed. With `state_dtype` (a bf16 state pool) the state is rounded to it
    after every token's output, exactly as token-at-a-time decoding through that pool rounds it between
    calls, so a T-token call equals T one-token calls bit for bit.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    batch, heads, length, dk = k.shape
    dv = v.shape[-1]
    if initial_state is None:
        state = torch.zeros(batch, heads, dk, dv, dtype=v.dtype, device=v.device)
    else:
        state = initial_state.to(v.dtype)
    out = torch.zeros_like(v)
    states = []
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)  # [B, Hv, dv]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
        if state_dtype is not None and state_dtype != state.dtype:
            state = state.to(state_dtype).to(v.dtype)  # what a store to and load from the pool does
        states.append(state)
    return out.transpose(1, 2).contiguous().to(out_dtype), torch.stack(states, dim=1)


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel delta rule (prefill). Returns (output [B, T, Hv, dv] in q's dtype, final state fp32).

    Inside a chunk the sequential updates are folded into a lower-triangular system (the UT transform), solved
    once; across chunks the state is carried sequentially.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    batch, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    num_chunks = (length + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(batch, heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(batch, heads, num_chunks, chunk_size)
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)

    cum_g = g.cumsum(dim=3)  # log of the decay from the chunk start to each position
    pair_decay = (cum_g.unsqueeze(4) - cum_g.unsqueeze(3)).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    decayed_k_beta = k_beta * cum_g.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        state = torch.zeros(batch, heads, dk, dv, dtype=v.dtype, device=v.device)
    else:
        state = initial_state.to(v.dtype)
    out = torch.zeros_like(new_values)
    q = q * cum_g.exp().unsqueeze(-1)
    k = k * (cum_g[..., -1:] - cum_g).exp().unsqueeze(-1)
    chunk_decay = cum_g[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


# ---- decode / verify: fused gates + l2norm + recurrence over T = 1..K+1 tokens, on a request's pooled slots ----


def gate_values(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):  # noqa: N803
    """GDN gates from the projections, with HF's dtypes: g = -exp(A_log) * softplus(a + dt_bias) in fp32 (log
    decay), beta = sigmoid(b) in the activation dtype."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


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
    g, beta = gate_values(a, b, A_log, dt_bias)
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
    def kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, pool_ptr, rows_ptr, committed_ptr, out_ptr,
        T, HV, GROUP, scale,
        sq_b, sq_t, sq_h, sv_b, sv_t, sv_h, sa_b, sa_t,
        sp_r, sp_s, sp_h, so_b, so_t, so_h,
        DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # One program: one request, one value head, BLOCK_V value columns, all T tokens in order. The state
        # tile [DK, BLOCK_V] lives in registers (read from the start slot before any slot is written; other
        # programs touch other heads/columns); nothing in it depends on other requests or on T.
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
        for t in range(T):
            q = tl.load(q_ptr + bi * sq_b + t * sq_t + hk * sq_h + ks).to(tl.float32)
            k = tl.load(k_ptr + bi * sq_b + t * sq_t + hk * sq_h + ks).to(tl.float32)
            v = tl.load(v_ptr + bi * sv_b + t * sv_t + h * sv_h + vs, mask=vmask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + bi * sa_b + t * sa_t + h).to(tl.float32)
            b = tl.load(b_ptr + bi * sa_b + t * sa_t + h)
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

    return kernel


def gdn_recurrent_triton(q, k, v, a, b, A_log, dt_bias, pool, rows, committed):  # noqa: N803
    """Triton version of `gdn_recurrent_reference` (same arguments, same in-place pool update)."""
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
    block_v = min(32, triton.next_power_of_2(dv))
    _gdn_recurrent_kernel()[(batch * hv, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, pool, rows, committed, out,
        length, hv, hv // hk, dk**-0.5,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), out.stride(0), out.stride(1), out.stride(2),
        DK=dk, DV=dv, BLOCK_V=block_v,
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


@gdn_recurrent.register_kernel("cuda")
def _(q, k, v, a, b, A_log, dt_bias, pool, rows, committed):  # noqa: N803
    return gdn_recurrent_triton(q, k, v, a, b, A_log, dt_bias, pool, rows, committed)


@gdn_recurrent.register_fake
def _(q, k, v, a, b, A_log, dt_bias, pool, rows, committed):  # noqa: N803
    return v.new_empty(v.shape)  # contiguous, as both implementations return
