"""The MoE ops: the router's choice (`qwen_mtp::moe_route`) and the routed experts with the shared expert added
(`qwen_mtp::moe`), each a plain-torch reference beside its Triton kernels.

Reference (CPU, and CUDA prefill): Hugging Face's computation step for step. The router: softmax in fp32,
`torch.topk`, renormalise, cast to the activation dtype. The experts (HF's default "grouped_mm" path): pairs
(token, slot) sorted by expert, one grouped GEMM per projection, each expert output times its routing weight
(rounded), the k products of a token summed in fp32 with one rounding, then `+ sigmoid(gate) * shared`. With
`invariant` (decode, verify, draft) every pair is its own 1-row product, so a token's numbers never depend on
the other tokens.

Triton (CUDA decode path), batch-invariant and free of host syncs (graph-capturable):
1. `_route_kernel`, a program per token: softmax, top-k by repeated argmax (a tie goes to the lowest expert id:
   a per-row rule, where `torch.topk` on CUDA may pick by kernel, which depends on the row count),
   renormalisation summed in slot order.
2. `_align_kernel`, one program: counts per expert, their offsets, the pairs grouped by expert, and the list of
   experts hit (slot s -> expert, -1 past the last).
3. `_gate_up_kernel`, a program per (slot, column tile of I): the expert's rows in tiles of BLOCK_M pairs,
   gate and up accumulated over H in one order, SwiGLU rounded as the eager ops round.
4. `_down_kernel`, the same over I, times the routing weight (rounded as HF's product).
5. `_combine_kernel`, a program per (token, column block): the k weighted outputs summed in slot order in fp32,
   rounded, plus `sigmoid(gate) * shared`, rounded as the eager ops.
A pair's result never depends on which pairs share its tile or how many rows its expert got: every `tl.dot`
has the one shape BLOCK_M x BLOCK_K x BLOCK_N, a row only meets its own accumulator, K blocks are added in one
order, tile sizes come from the weights' shape, and no loop bound that varies (rows of an expert) changes a
row's arithmetic. Only the weights of experts that some token picked are read.

FP8 block experts (W8A16): an e4m3 weight [E, N, K] with fp32 block scales [E, ceil(N/128), ceil(K/128)]
(`gate_up_scale`, `down_scale`; either may be None for a weight kept in the activations' dtype). Kernels 3 and 4
load one scale per 128 x 128 block and dequantize each weight tile in registers with transformers' formula
(`triton_utils.fp8_dequantize`), so the FP8 pipeline gives bit for bit what the bf16 one gives on the
dequantized experts. The reference dequantizes the experts some token picked (`torch.unique` of the ids: a host
sync, fine for prefill and CPU; all of them inside a graph capture) and runs the plain reference on them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qwen_mtp.ops import elementwise, triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.linear import dequantize_weight, rowwise_products
from qwen_mtp.ops.triton_utils import INTERPRET
from qwen_mtp.quant.fp8 import FP8_BLOCK

BLOCK_M = 16  # pairs per tl.dot (tl.dot's minimum), fixed: the row count of every MMA never depends on routing
# (16 rows: below wgmma's 64, so every dot runs as mma.sync, which the FP8 tiles' dequantization must know to lay
# its operand out as the bf16 kernel's: `triton_helpers.fp8_dequantize`, MMA_SYNC)
BLOCK_K = 64
ALIGN_CHUNK = 128  # pairs per step of the alignment loop


# --------------------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------------------


def route_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k] int64), as HF computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def _expert_swiglu(gate_up: torch.Tensor, invariant: bool) -> torch.Tensor:
    """silu(gate) * up on the strided halves of the experts' gate_up output, as HF's experts compute it (not
    `swiglu_reference`, which copies the gate first as HF's dense MLP sees it: CPU silu rounds the two apart).
    `invariant`: every element rounded the same way (`ops/elementwise.py`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return elementwise.silu(gate, invariant) * up


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [S, K] (grouped by expert) @ weight [E, K, N] per group -> [S, N], as HF's grouped GEMM: torch's
    `grouped_mm` where it runs (CPU, CUDA bf16), else a product per expert (one host read of the offsets)."""
    if hasattr(F, "grouped_mm") and (rows.device.type == "cpu" or rows.dtype == torch.bfloat16):
        return F.grouped_mm(rows.to(weight.dtype), weight, offs=offsets)
    out = rows.new_zeros(rows.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(rows[start:end], weight[expert], out=out[start:end])
        start = end
    return out


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    invariant: bool,
) -> torch.Tensor:
    """Routed experts: x [N, H], gate_up [E, 2I, H], down [E, H, I], routing weights / ids [N, k] -> [N, H]."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    if invariant:  # every (token, slot) pair its own 1-row product
        flat = ids.reshape(-1)
        rows = x.repeat_interleave(top_k, dim=0)[:, None]  # [P, 1, H], pair p = token p // k
        h = _expert_swiglu(rowwise_products(rows, gate_up[flat].transpose(1, 2)), invariant)
        out = rowwise_products(h, down[flat].transpose(1, 2))[:, 0]
        weighted = out * weights.reshape(-1, 1)
    else:  # HF's grouped GEMM path, step for step
        experts = ids.reshape(-1)
        sorted_experts, perm = torch.sort(experts)
        rows = x[perm // top_k]
        counted = sorted_experts.float() if x.device.type == "cpu" else sorted_experts.int()
        counts = torch.histc(counted, bins=gate_up.shape[0], min=0, max=gate_up.shape[0] - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = _expert_swiglu(_grouped_mm(rows, gate_up.transpose(-2, -1), offsets), invariant)
        out = _grouped_mm(h, down.transpose(-2, -1), offsets)
        weighted = out * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        weighted = weighted[inverse]
    return weighted.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _picked_experts_dequantized(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate_up, down, ids) over only the experts some token picked, the FP8 ones dequantized to `dtype`: the
    same products as over all experts dequantized, without expanding the experts nobody reads. Inside a CUDA
    graph capture (the reference forced on the decode path) every expert: finding the picked ones syncs."""
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        picked, local = torch.arange(gate_up.shape[0], device=ids.device), ids
    else:
        picked = torch.unique(ids)  # sorted: local expert j is global expert picked[j]
        local = torch.searchsorted(picked, ids)

    def experts(weight, scale):
        return weight[picked] if scale is None else dequantize_weight(weight[picked], scale[picked], dtype)

    return experts(gate_up, gate_up_scale), experts(down, down_scale), local


def moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor,
    shared_gate: torch.Tensor,
    invariant: bool,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE block's output: routed experts + sigmoid(shared_gate [N, 1]) * shared [N, H], rounded as HF.
    With block scales the experts are FP8 (see the module docstring)."""
    if gate_up_scale is not None or down_scale is not None:
        gate_up, down, ids = _picked_experts_dequantized(gate_up, down, ids, gate_up_scale, down_scale, x.dtype)
    routed = experts_reference(x, gate_up, down, weights, ids, invariant)
    return routed + elementwise.sigmoid(shared_gate, invariant) * shared


# --------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def _route_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def moe_route_topk(
        logits_ptr, weights_ptr, ids_ptr, E, s_row, TOP_K: tl.constexpr, E_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        es = tl.arange(0, E_BLOCK)
        logits = tl.load(logits_ptr + row * s_row + es, mask=es < E, other=float("-inf")).to(tl.float32)
        exps = tl.exp(logits - tl.max(logits, axis=0))
        probs = exps / tl.sum(exps, axis=0)
        left = tl.where(es < E, probs, -1.0)  # probabilities >= 0: -1 marks taken or absent experts
        picked = tl.zeros([E_BLOCK], dtype=tl.float32)  # probability at its slot's position, slot order below
        slot_of = tl.full([E_BLOCK], -1, dtype=tl.int32)
        total = 0.0
        for j in tl.static_range(TOP_K):
            best = tl.max(left, axis=0)
            expert = tl.min(tl.where(left == best, es, E_BLOCK), axis=0)  # a tie goes to the lowest expert id
            total += best  # in slot order 0, 1, ...
            slot_of = tl.where(es == expert, j, slot_of)
            picked = tl.where(es == expert, best, picked)
            left = tl.where(es == expert, -1.0, left)
        if NORMALIZE:
            picked = picked / total
        chosen = slot_of >= 0
        tl.store(weights_ptr + row * TOP_K + slot_of, picked.to(weights_ptr.dtype.element_ty), mask=chosen)
        tl.store(ids_ptr + row * TOP_K + slot_of, es.to(tl.int64), mask=chosen)

    return moe_route_topk


def route_triton(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    tokens, experts = logits.shape
    weights = logits.new_empty(tokens, top_k)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel()[(tokens,)](
            logits, weights, ids, experts, logits.stride(0),
            TOP_K=top_k, E_BLOCK=triton.next_power_of_2(experts), NORMALIZE=normalize,
            **triton_utils.launch(logits.device),
        )  # fmt: skip
    return weights, ids


@functools.cache
def _align_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["P"])
    def moe_align(
        ids_ptr, counts_ptr, offsets_ptr, cursor_ptr, order_ptr, slots_ptr, P, E, SLOTS, E_BLOCK: tl.constexpr, CHUNK:
        tl.constexpr, PDL: tl.constexpr = False
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        es = tl.arange(0, E_BLOCK)
        counts = tl.zeros([E_BLOCK], dtype=tl.int32)
        for p0 in range(0, P, CHUNK):
            ps = p0 + tl.arange(0, CHUNK)
            expert = tl.load(ids_ptr + ps, mask=ps < P, other=E_BLOCK - 1).to(tl.int32)  # E_BLOCK > E: a spare bin
            counts += tl.histogram(expert, E_BLOCK)
        counts = tl.where(es < E, counts, 0)
        offsets = tl.cumsum(counts, axis=0) - counts
        hit = counts > 0
        slot = tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(counts_ptr + es, counts, mask=es < E)
        tl.store(offsets_ptr + es, offsets, mask=es < E)
        tl.store(cursor_ptr + es, offsets, mask=es < E)
        tl.store(slots_ptr + slot, es, mask=hit)
        tl.store(slots_ptr + es, -1, mask=(es > tl.max(slot, axis=0)) & (es < SLOTS))
        tl.debug_barrier()  # the cursors are stored before the pairs claim places from them
        for p0 in range(0, P, CHUNK):
            ps = p0 + tl.arange(0, CHUNK)
            expert = tl.load(ids_ptr + ps, mask=ps < P, other=0).to(tl.int32)
            # The order of the pairs inside an expert's group may vary from run to run: a pair's result does
            # not depend on where in its tile it sits.
            place = tl.atomic_add(cursor_ptr + expert, 1, mask=ps < P)
            tl.store(order_ptr + place, ps, mask=ps < P)

    return moe_align


@functools.cache
def _gate_up_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gate_up(
        x_ptr, w_ptr, s_ptr, h_ptr, order_ptr, counts_ptr, offsets_ptr, slots_ptr, H, INTER, s_x, s_we, s_wn, ss_e,
        ss_n, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8:
        tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False
    ):  # fmt: skip
        # FP8: w_ptr is e4m3 and s_ptr its block scales [E, ceil(2I/128), ceil(H/128)]; else s_ptr is unused.
        triton_utils.wait_for_previous_kernel(PDL)
        expert = tl.load(slots_ptr + tl.program_id(0))
        if expert >= 0:
            count = tl.load(counts_ptr + expert)
            start = tl.load(offsets_ptr + expert)
            ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            w_gate = w_ptr + expert.to(tl.int64) * s_we + ns[:, None] * s_wn
            w_up = w_gate + INTER * s_wn
            scales = s_ptr + expert.to(tl.int64) * ss_e
            for r0 in range(0, count, BLOCK_M):
                rows = r0 + tl.arange(0, BLOCK_M)
                live = rows < count
                pair = tl.load(order_ptr + start + rows, mask=live, other=0)
                token = (pair // TOP_K).to(tl.int64)
                acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    kmask = (k0 + ks) < H
                    x = tl.load(x_ptr + token[:, None] * s_x + (k0 + ks)[None, :],
                                mask=live[:, None] & kmask[None, :], other=0.0)  # fmt: skip
                    wmask = (ns[:, None] < INTER) & kmask[None, :]
                    wg = tl.load(w_gate + (k0 + ks)[None, :], mask=wmask, other=0.0)
                    wu = tl.load(w_up + (k0 + ks)[None, :], mask=wmask, other=0.0)
                    if FP8:  # the up rows are rows I.. of the expert's [2I, H] weight and scale grid
                        dtype_x = x_ptr.dtype.element_ty
                        wg = triton_utils.fp8_dequantize(
                            wg, scales, ns, k0, ss_n, INTER, H, BLOCK_N, BLOCK_K, dtype_x, INTERPRETED, MMA_SYNC=True
                        )
                        wu = triton_utils.fp8_dequantize(
                            wu, scales, INTER + ns, k0, ss_n, 2 * INTER, H, BLOCK_N, BLOCK_K, dtype_x, INTERPRETED,
                            MMA_SYNC=True,
                        )  # fmt: skip
                    acc_gate += triton_utils.dot(x, tl.trans(wg), INTERPRETED, PRECISION)
                    acc_up += triton_utils.dot(x, tl.trans(wu), INTERPRETED, PRECISION)
                dtype = h_ptr.dtype.element_ty
                gate = acc_gate.to(dtype).to(tl.float32)  # each projection rounded, as the GEMM outputs
                up = acc_up.to(dtype).to(tl.float32)
                silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
                mask = live[:, None] & (ns[None, :] < INTER)
                tl.store(h_ptr + pair.to(tl.int64)[:, None] * INTER + ns[None, :], (silu * up).to(dtype), mask=mask)

    return moe_gate_up


@functools.cache
def _down_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def moe_down(
        h_ptr, w_ptr, s_ptr, rw_ptr, y_ptr, order_ptr, counts_ptr, offsets_ptr, slots_ptr, H, INTER, s_we, s_wn, ss_e,
        ss_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, INTERPRETED:
        tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False
    ):  # fmt: skip
        # FP8: w_ptr is e4m3 and s_ptr its block scales [E, ceil(H/128), ceil(I/128)]; else s_ptr is unused.
        triton_utils.wait_for_previous_kernel(PDL)
        expert = tl.load(slots_ptr + tl.program_id(0))
        if expert >= 0:
            count = tl.load(counts_ptr + expert)
            start = tl.load(offsets_ptr + expert)
            ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            w_rows = w_ptr + expert.to(tl.int64) * s_we + ns[:, None] * s_wn
            scales = s_ptr + expert.to(tl.int64) * ss_e
            for r0 in range(0, count, BLOCK_M):
                rows = r0 + tl.arange(0, BLOCK_M)
                live = rows < count
                pair = tl.load(order_ptr + start + rows, mask=live, other=0).to(tl.int64)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, INTER, BLOCK_K):
                    kmask = (k0 + ks) < INTER
                    h = tl.load(h_ptr + pair[:, None] * INTER + (k0 + ks)[None, :],
                                mask=live[:, None] & kmask[None, :], other=0.0)  # fmt: skip
                    w = tl.load(w_rows + (k0 + ks)[None, :], mask=(ns[:, None] < H) & kmask[None, :], other=0.0)
                    if FP8:
                        w = triton_utils.fp8_dequantize(
                            w, scales, ns, k0, ss_n, H, INTER, BLOCK_N, BLOCK_K, h_ptr.dtype.element_ty, INTERPRETED,
                            MMA_SYNC=True,
                        )  # fmt: skip
                    acc += triton_utils.dot(h, tl.trans(w), INTERPRETED, PRECISION)
                dtype = y_ptr.dtype.element_ty
                routing = tl.load(rw_ptr + pair, mask=live, other=0.0).to(tl.float32)
                weighted = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
                mask = live[:, None] & (ns[None, :] < H)
                tl.store(y_ptr + pair[:, None] * H + ns[None, :], weighted, mask=mask)

    return moe_down


@functools.cache
def _combine_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def moe_combine(
        y_ptr, shared_ptr, gate_ptr, out_ptr, H, s_shared, s_gate, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # slot order, fp32, one rounding (HF's sum over the k products)
            acc += tl.load(y_ptr + (token * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gate_ptr + token * s_gate).to(tl.float32)
        scale = tl.sigmoid(gate).to(dtype).to(tl.float32)
        shared = tl.load(shared_ptr + token * s_shared + cols, mask=mask, other=0.0).to(tl.float32)
        scaled = (scale * shared).to(dtype).to(tl.float32)
        tl.store(out_ptr + token * H + cols, (acc.to(dtype).to(tl.float32) + scaled).to(dtype), mask=mask)

    return moe_combine


def _scales_or(scale: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """The scale pointer a kernel gets: the block scales, or any tensor (unread) for a weight in the model dtype."""
    return weight if scale is None else scale


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if scale is None else (scale.stride(0), scale.stride(1))


def _block_n(n: int) -> int:
    """Column tile of the expert GEMMs: a function of the weight's shape only."""
    return 64 if n >= 1024 else 32


def moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor,
    shared_gate: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe_reference(..., invariant=True)` in five launches, batch-invariant (see the module docstring); with
    block scales the experts are FP8, dequantized tile by tile in registers."""
    import triton

    tokens, hidden = x.shape
    experts, two_i, _ = gate_up.shape
    inter, top_k = two_i // 2, ids.shape[1]
    pairs = tokens * top_k
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x = x.contiguous()
    assert gate_up.stride(2) == 1 and down.stride(2) == 1 and shared.stride(1) == 1
    for weight, scale in ((gate_up, gate_up_scale), (down, down_scale)):
        if scale is not None:
            assert weight.dtype == torch.float8_e4m3fn and scale.stride(2) == 1, "e4m3 experts, contiguous scales"
            assert tuple(scale.shape[1:]) == (-(-weight.shape[1] // FP8_BLOCK[0]), -(-weight.shape[2] // FP8_BLOCK[1]))
    device, slots = x.device, min(pairs, experts)
    counts = torch.empty(experts, dtype=torch.int32, device=device)
    offsets, cursor = torch.empty_like(counts), torch.empty_like(counts)
    order = torch.empty(pairs, dtype=torch.int32, device=device)
    slot_experts = torch.empty(slots, dtype=torch.int32, device=device)
    e_block = triton.next_power_of_2(experts + 1)
    _align_kernel()[(1,)](
        ids.reshape(-1), counts, offsets, cursor, order, slot_experts, pairs, experts, slots,
        E_BLOCK=e_block, CHUNK=ALIGN_CHUNK, num_warps=8 if e_block >= 512 else 4, **triton_utils.launch(ids.device),
    )  # fmt: skip
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(pairs, inter, dtype=x.dtype, device=device)
    block_n = _block_n(inter)
    _gate_up_kernel()[(slots, triton.cdiv(inter, block_n))](
        x, gate_up, _scales_or(gate_up_scale, gate_up), h, order, counts, offsets, slot_experts, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), *_scale_strides(gate_up_scale),
        TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, FP8=gate_up_scale is not None,
        INTERPRETED=INTERPRET, PRECISION=precision, **triton_utils.launch(x.device),
    )  # fmt: skip
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=device)
    block_n = _block_n(hidden)
    _down_kernel()[(slots, triton.cdiv(hidden, block_n))](
        h, down, _scales_or(down_scale, down), weights.reshape(-1).contiguous(), y, order, counts, offsets,
        slot_experts, hidden, inter, down.stride(0), down.stride(1), *_scale_strides(down_scale),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, FP8=down_scale is not None,
        INTERPRETED=INTERPRET, PRECISION=precision, **triton_utils.launch(h.device),
    )  # fmt: skip
    block = 1024
    _combine_kernel()[(tokens, triton.cdiv(hidden, block))](
        y, shared, shared_gate, out, hidden, shared.stride(0), shared_gate.stride(0), TOP_K=top_k, BLOCK=block,
        **triton_utils.launch(y.device),
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("qwen_mtp::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: router logits [N, E] -> (weights [N, k], expert ids [N, k] int64). `route_reference` on CPU
    (HF's `torch.topk` choice, ties included), the Triton kernel on CUDA (ties to the lowest expert id)."""
    weights, ids = route_reference(logits, top_k, normalize)
    return weights.contiguous(), ids.contiguous()


@cuda_kernel(moe_route)
def _(logits, top_k, normalize):
    if reference_forced("moe_route"):
        weights, ids = route_reference(logits, top_k, normalize)
        return weights.contiguous(), ids.contiguous()
    return route_triton(logits, top_k, normalize)


@moe_route.register_fake
def _(logits, top_k, normalize):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("qwen_mtp::moe", mutates_args=())
def moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: torch.Tensor,
    shared_gate: torch.Tensor,
    invariant: bool,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Custom op: the MoE block's output [N, H] (`moe_reference`); on CUDA with `invariant` the Triton pipeline.
    `gate_up_scale` / `down_scale`: the block scales of FP8 experts (None: the weight is in the model dtype)."""
    return moe_reference(
        x, gate_up, down, weights, ids, shared, shared_gate, invariant, gate_up_scale, down_scale
    ).contiguous()


@cuda_kernel(moe)
def _(x, gate_up, down, weights, ids, shared, shared_gate, invariant, gate_up_scale=None, down_scale=None):
    # Prefill (not invariant): bf16 experts run the grouped GEMM (at 35B-A3B shapes on the H200, 0.92 ms against
    # the fused kernels' 2.2 ms at 2048 tokens; 0.70 against 0.64 at 512). FP8 experts always take the fused
    # kernels: the reference dequantizes every picked expert first (9.0 ms at 512 tokens against 0.55 ms fused;
    # benchmarks/moe_kernel.py).
    fp8 = gate_up_scale is not None or down_scale is not None
    if reference_forced("moe") or not (invariant or fp8):
        return moe_reference(
            x, gate_up, down, weights, ids, shared, shared_gate, invariant, gate_up_scale, down_scale
        ).contiguous()
    return moe_triton(x, gate_up, down, weights, ids, shared, shared_gate, gate_up_scale, down_scale)


@moe.register_fake
def _(x, gate_up, down, weights, ids, shared, shared_gate, invariant, gate_up_scale=None, down_scale=None):
    return torch.empty_like(x)


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)

register_reference_autograd(moe_route, route_reference)
register_reference_autograd(moe, moe_reference)
