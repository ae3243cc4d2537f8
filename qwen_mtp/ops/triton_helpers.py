"""The `@triton.jit` helpers that several kernels call, written once: a dot product whose result rows never depend
on the other rows (also under the CPU interpreter), and the paged-attention key loop shared by decode/verify and
prefill attention (int64 page-slot addresses, the online-softmax update). Kernels reach them as
`triton_utils.<helper>` (see there why); this module needs Triton.
"""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):  # noqa: N803
    """a [M, K] @ b [K, N], accumulated in fp32.

    Compiled: `tl.dot` at `PRECISION` on the inputs as given. Interpreted (the CPU tests), `tl.dot` is numpy's
    matmul, which is wrong on 16-bit inputs and, through OpenBLAS, rounds a row by where it sits in the tile (rows
    6-11 of 16 differed on an AVX-512 machine running OpenBLAS's Haswell kernels): the tests could not tell a
    kernel whose rows depend on each other from one whose rows do not. So the interpreter sums fp32 products over
    K on its own for every (row, column), in an order that depends on K alone.
    """
    if INTERPRETED:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def precise_dot(a, b, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):  # noqa: N803
    """a [M, K] @ b [K, N] to fp32 accuracy whatever the operands' dtypes, in the cheapest exact tensor-core form:
    - both 16-bit (raw bf16 / fp16 inputs): one product, exact in fp32;
    - one bf16 and one fp32 (raw inputs times computed values): the fp32 one split into three bf16 pieces
      (x = x1 + x2 + x3 up to 2^-27 |x|: its own 24 bits), each product exact: three bf16 products, as accurate
      as an fp32 dot at half of `tf32x3`'s tensor-core work, the bf16 operand never converted;
    - otherwise (fp32, or fp16 beside fp32): `dot` of both in fp32 at `PRECISION`.
    Interpreted: `dot` of both in fp32 (all products exact there)."""
    if INTERPRETED:
        return dot(a.to(tl.float32), b.to(tl.float32), INTERPRETED, PRECISION)
    elif a.dtype == b.dtype and a.dtype != tl.float32:
        return tl.dot(a, b)
    elif a.dtype == tl.bfloat16 and b.dtype == tl.float32:
        b1 = b.to(tl.bfloat16)
        rest = b - b1.to(tl.float32)
        b2 = rest.to(tl.bfloat16)
        b3 = (rest - b2.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(a, b1, tl.dot(a, b2, tl.dot(a, b3)))  # smallest pieces first
    elif a.dtype == tl.float32 and b.dtype == tl.bfloat16:
        a1 = a.to(tl.bfloat16)
        rest = a - a1.to(tl.float32)
        a2 = rest.to(tl.bfloat16)
        a3 = (rest - a2.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(a1, b, tl.dot(a2, b, tl.dot(a3, b)))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)


@triton.jit
def fp8_dequantize(w, scale_ptr, ns, k0, s_n, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):  # noqa: N803
    """An e4m3 weight tile w [BLOCK_N, BLOCK_K] (rows `ns`, columns k0..k0+BLOCK_K) -> `dtype`, each element times
    its 128x128 block's scale (scale_ptr: [ceil(N/128), ceil(K/128)], row stride s_n) in fp32 and rounded once:
    transformers' `(fp8.float() * scale.float()).to(dtype)`, so the tile equals the dequantized weight's.
    A tile of at most 128 columns lies in one block column (k0 is a multiple of BLOCK_K); a wider one spans
    BLOCK_K // 128 of them."""
    if BLOCK_K <= 128:
        scale = tl.load(scale_ptr + (ns // 128) * s_n + k0 // 128, mask=ns < N, other=0.0)  # [BLOCK_N]
        return (w.to(tl.float32) * scale[:, None]).to(dtype)
    else:
        blocks = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        mask = (ns[:, None] < N) & (blocks[None, :] < tl.cdiv(K, 128))
        scale = tl.load(scale_ptr + (ns // 128)[:, None] * s_n + blocks[None, :], mask=mask, other=0.0)
        scaled = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 128, 128)) * scale[:, :, None]
        return tl.reshape(scaled, (BLOCK_N, BLOCK_K)).to(dtype)


@triton.jit
def kv_slots(table_ptr, pos, mask, PAGE: tl.constexpr, s_page, s_slot):  # noqa: N803
    """Element offsets of positions `pos` in a request's KV pages (`table_ptr`: its row of the page table; `mask`:
    which positions exist) in the cache [2, pages, PAGE, KV, D]. In int64: pages x page stride passes 2^31 elements
    in large pools (e.g. 0.8B shapes, >65536 pages)."""
    page = tl.load(table_ptr + pos // PAGE, mask=mask, other=0)
    return page.to(tl.int64) * s_page + (pos % PAGE) * s_slot


@triton.jit
def load_kv_block(kv_ptr, table_ptr, pos, mask, head_offset, ds, PAGE: tl.constexpr, s_half, s_page, s_slot):  # noqa: N803
    """Keys and values [N, D] of positions `pos` [N] (where `mask`; zeros elsewhere) of one KV head (`head_offset`
    into a slot; `ds` the arange over D), each position read from its own page: any page size works."""
    slot = kv_slots(table_ptr, pos, mask, PAGE, s_page, s_slot)[:, None] + head_offset + ds[None, :]
    k = tl.load(kv_ptr + slot, mask=mask[:, None], other=0.0)
    v = tl.load(kv_ptr + s_half + slot, mask=mask[:, None], other=0.0)
    return k, v


@triton.jit
def attend_block(q, k, v, visible, scale, m, denom, acc, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):  # noqa: N803
    """One block of keys into a flash-attention running state (online softmax).

    q [R, D] query rows; k, v [N, D]; visible [R or 1, N]: which keys each row sees; m, denom [R]: the running
    maximum score and sum of exponentials; acc [R, D] the running weighted sum of values. Returns the updated
    (m, denom, acc); the output is acc / denom once every block is in. A row's numbers depend on its own query and
    keys and on the block order only.
    """
    scores = dot(q, tl.trans(k), INTERPRETED, PRECISION)
    scores = tl.where(visible, scores * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, INTERPRETED, PRECISION)
    return m_new, denom, acc


@triton.jit
def mix32(x):
    """The `lowbias32` integer finalizer on uint32 values (wrapping multiplies, logical shifts): the sampler's
    counter-based noise (`ops/sampling.py`, whose torch reference computes the same bits in int64)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def packed_chunk(cu_ptr, n_seqs, chunk, C: tl.constexpr):  # noqa: N803
    """Where chunk number `chunk` lies among sequences packed back to back (`cu_ptr`: their cumulative lengths,
    [n_seqs + 1] int32), each cut into C-token chunks from its own start, numbered sequence after sequence:
    (its first token, its sequence's end); (0, 0) for a number past the last chunk. A loop over the sequences
    with a runtime count, so one binary serves every packing (a sequence's numbers never depend on its
    neighbours)."""
    first = chunk * 0
    end = chunk * 0
    before = chunk * 0
    for s in range(n_seqs):
        lo = tl.load(cu_ptr + s)
        hi = tl.load(cu_ptr + s + 1)
        count = (hi - lo + C - 1) // C
        inside = (chunk >= before) & (chunk < before + count)
        first = tl.where(inside, lo + (chunk - before) * C, first)
        end = tl.where(inside, hi, end)
        before += count
    return first, end
