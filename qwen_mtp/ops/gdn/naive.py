"""Gated delta rule (the recurrence inside a Gated DeltaNet layer), in plain PyTorch: the reference the Triton
kernels beside it (`recurrent.py`, `chunked.py`) must equal, and what CPU runs.

Two equivalent forms, as in Hugging Face and flash-linear-attention:
- `recurrent_gated_delta_rule`: one token at a time; used for decode and speculative verify, where a
  position's result must not depend on how many tokens share the call.
- `chunked_gated_delta_rule`: the chunk-parallel (UT transform) form used for prefill; it equals the recurrent
  form up to fp32 rounding (~1e-7); `chunked_gated_delta_rule_varlen` runs it over sequences packed back to back.

Math per value head, state S in R^{dk x dv}, in fp32:
    q, k <- l2norm(q), l2norm(k);  q <- q * dk^-0.5
    S <- exp(g_t) * S;  delta = beta_t * (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
Shapes: q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; state [B, Hv, dk, dv] (fp32; fp64 when the
inputs are fp64, which tests use to separate rounding from bugs).
The operation order follows Hugging Face's torch path so CPU results match it bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen_mtp.ops import elementwise


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


def chunked_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_gated_delta_rule` over N sequences packed back to back along T (q, k [1, T, Hk, dk]; v [1, T, Hv,
    dv]; g, beta [1, T, Hv]; cu_seqlens [N + 1]: their cumulative lengths; initial_state [N, Hv, dk, dv] or None),
    each on its own. Returns (output [1, T, Hv, dv], final states [N, Hv, dk, dv])."""
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        init = None if initial_state is None else initial_state[n : n + 1]
        if end == start:  # nothing to run: the state passes through
            dk, dv = k.shape[-1], v.shape[-1]
            final = torch.zeros(1, v.shape[2], dk, dv, dtype=torch.promote_types(q.dtype, torch.float32))
            finals.append(final.to(v.device) if init is None else init.to(final.dtype))
            continue
        out, final = chunked_gated_delta_rule(*(x[:, start:end] for x in (q, k, v, g, beta)), initial_state=init)
        outs.append(out)
        finals.append(final)
    out = torch.cat(outs, dim=1) if outs else v.new_empty(v.shape, dtype=q.dtype)
    return out, torch.cat(finals, dim=0)


def gate_values(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803
    dt_bias: torch.Tensor,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN gates from the projections, with HF's dtypes: g = -exp(A_log) * softplus(a + dt_bias) in fp32 (log
    decay), beta = sigmoid(b) in the activation dtype. `invariant` (decode, verify): a token's gates round the
    same whatever the batch and T (`ops/elementwise.py`)."""
    decay = elementwise.softplus(a.float() + dt_bias, invariant)
    return -A_log.float().exp() * decay, elementwise.sigmoid(b, invariant)
