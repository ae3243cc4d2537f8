"""The `@triton.jit` helpers that several kernels call, written once: a dot product whose result rows never depend
on the other rows (also under the CPU interpreter), the paged-attention key loop shared by decode/verify and
prefill attention (int64 page-slot addresses, the online-softmax update), the sampler's order keys and fixed-point
masses, the norm kernel's row scaling (shared by its one-pass and chunked paths), and the W8A8 activation
quantization that a norm or SwiGLU kernel does for the product it feeds. Kernels reach them as
`triton_utils.<helper>` (see there why); this module needs Triton.
"""

import triton
import triton.language as tl

from qwen_mtp.ops import sampling as _sampling


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):  # noqa: N803
    """Every kernel's first statement (`triton_utils.launch` says why). With programmatic dependent launch this
    program may start while the kernel before it in the stream still runs: wait until that kernel has finished
    and its writes are visible (which also covers every kernel before it), then let the next kernel's programs
    launch. Nothing before this line reads or writes memory. Without PDL both instructions are no-ops."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_weight_rows(w_ptr, n0, k0, N, K, sw_n, BLOCK_N: tl.constexpr, PREFETCH_K: tl.constexpr,  # noqa: N803
                         PREFETCH_BYTES: tl.constexpr):  # fmt: skip
    """A GEMM program's only statement before `wait_for_previous_kernel`: ask L2 for the first PREFETCH_K columns
    from k0 of weight rows n0 .. n0 + BLOCK_N (row stride sw_n; rows clamped to N - 1, columns to K), PREFETCH_BYTES
    bytes a row, with one bulk prefetch a row (`cp.async.bulk.prefetch.L2.global`: no registers or shared memory
    hold the bytes, nothing waits for them). With programmatic dependent launch the program runs while the kernel
    before it still does, often a short one (a norm, a quantization) that leaves HBM idle: the weight's first
    blocks stream meanwhile and the K loop finds them in L2. Weights are never written during a step, so reading
    them early races with nothing, and the product's bits are untouched. PREFETCH_K = 0 (the default, every CPU
    and interpreter launch, every launch outside a CUDA graph): nothing. The host keeps addresses and sizes
    16-byte aligned, as the instruction requires (`linear.l2_prefetch_columns`)."""
    if PREFETCH_K > 0:
        rows = tl.minimum(n0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        start = tl.maximum(tl.minimum(k0, K - PREFETCH_K), 0)
        sizes = tl.full([BLOCK_N], PREFETCH_BYTES, tl.int32)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
            [w_ptr + rows * sw_n + start, sizes], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


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


# Two e4m3 bytes ($1) -> two bf16 ($0, one bf16x2) times their factors ($2): prmt sign-extends each byte to 16
# bits (selector nibbles 8, 9 replicate a byte's sign), shl + and keep sign | exponent | mantissa in bf16's places
# (the e4m3 value times 2^-120, exactly), fma with -0 rounds value x factor once (fma, not mul: sm_80 has it).
FP8_TO_BF16_SCALED = tl.constexpr("""
{
.reg .b32 t, z;
prmt.b32 t, $1, 0, 0x9180;
shl.b32 t, t, 4;
and.b32 t, t, 0x87F087F0;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, t, $2, z;
}
""")


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
def fp8_dequantize(w, scale_ptr, ns, k0, s_n, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr,  # noqa: N803
                   INTERPRETED: tl.constexpr = False, MMA_SYNC: tl.constexpr = False):  # noqa: N803  # fmt: skip
    """An e4m3 weight tile w [BLOCK_N, BLOCK_K] (rows `ns`, columns k0..k0+BLOCK_K) -> `dtype`, each element times
    its 128x128 block's scale (scale_ptr: [ceil(N/128), ceil(K/128)], row stride s_n), rounded once: transformers'
    `(fp8.float() * scale.float()).to(dtype)`, so the tile equals the dequantized weight's.

    Compiled in bf16 (the decode path), no conversion instruction runs per weight (Hopper converts at a quarter of
    its integer rate; e4m3 -> f16 -> fp32 -> bf16 took two a weight). Instead the e4m3 byte, sign-extended to 16
    bits, shifted left by 4 and masked, is the bit pattern of a bf16 equal to the e4m3 value times 2^-120 exactly
    (subnormals included: both formats keep the 3 mantissa bits right under the exponent, and bf16's exponent bias
    is 120 more), and one bf16 multiply by scale * 2^120 rounds the exact product once, as the reference does
    (`FP8_TO_BF16_SCALED`: four instructions per two weights). That factor is exact for scales that are bf16 values
    below 2^8 (a block amax below 114688): what Qwen's releases store and what `quant.fp8.quantize_fp8_block` gives
    a bf16 weight; an fp32 scale with more bits would be rounded to bf16 here. Interpreted, or in fp32 / fp16 (the
    CPU tests), the fp32 formula. A tile of at most 128 columns lies in one block column (k0 is a multiple of
    BLOCK_K); a wider one spans BLOCK_K // 128 of them.

    MMA_SYNC: the tile feeds a `tl.dot` that runs as mma.sync (`linear.feeds_mma_sync`). Triton lays out an
    mma.sync operand by the narrowest load it traces it back to through pure elementwise ops: from the e4m3 load
    each thread would hold 4 consecutive K values where the bf16 weight's layout holds 2, so the MMAs would add
    the same products in another grouping and round differently from the bf16 kernel. The asm is then marked
    impure, which ends that trace at it (the bf16 kernel's layout). wgmma plans keep it pure: their register
    operand layout is fixed, and the impure asm costs them layout conversions."""
    if BLOCK_K <= 128:
        scale = tl.load(scale_ptr + (ns // 128) * s_n + k0 // 128, mask=ns < N, other=0.0).to(tl.float32)[:, None]
    else:
        blocks = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        mask = (ns[:, None] < N) & (blocks[None, :] < tl.cdiv(K, 128))
        scale = tl.load(scale_ptr + (ns // 128)[:, None] * s_n + blocks[None, :], mask=mask, other=0.0)
        scale = scale.to(tl.float32)[:, :, None]  # [BLOCK_N, BLOCK_K // 128, 1]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // 128, 128))
    if dtype == tl.bfloat16 and not INTERPRETED:
        factor = (scale * 1.329227995784916e36).to(tl.bfloat16)  # scale * 2^120, exact
        bits = w.to(tl.int8, bitcast=True)
        if MMA_SYNC:
            scaled = tl.inline_asm_elementwise(FP8_TO_BF16_SCALED, "=r,r,r", [bits, factor], tl.bfloat16, False, 2)
        else:
            scaled = tl.inline_asm_elementwise(FP8_TO_BF16_SCALED, "=r,r,r", [bits, factor], tl.bfloat16, True, 2)
    else:
        scaled = w.to(tl.float32) * scale
    return tl.reshape(scaled, (BLOCK_N, BLOCK_K)).to(dtype)


@triton.jit
def scale_norm_row(x, inv, w, g_ptr, row, cols, mask, g_heads, g_s0, g_s1, GATED: tl.constexpr):  # noqa: N803
    """A norm row's output from x [fp32] and its 1/rms: x * inv * (1 + w) (Qwen's zero-centred norm), or
    GATED (the GDN output norm) w * (x * inv) in w's dtype, times silu of the row's gate read at `cols`."""
    if GATED:
        y = (w.to(tl.float32) * (x * inv).to(w.dtype).to(tl.float32)).to(w.dtype).to(tl.float32)
        g_row = g_ptr + (row // g_heads) * g_s0 + (row % g_heads) * g_s1
        g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * (g * tl.sigmoid(g))
    else:
        y = x * inv * (1.0 + w.to(tl.float32))
    return y


@triton.jit
def store_e4m3_groups(y, q_ptr, s_ptr, first, N, GROUPS: tl.constexpr, FLOOR: tl.constexpr):  # noqa: N803
    """The W8A8 activation quantization of one row's columns first .. first + GROUPS * 128 (first a multiple of
    128), done by the kernel that produced them: y [GROUPS * 128] fp32, already rounded to the activation dtype as
    stored; q_ptr [K] e4m3 and s_ptr [K / 128] fp32 point at the row. Each 1x128 group's amax maps to 448, one
    correctly rounded division an element: the very operations of the separate quantization kernel
    (`linear._quantize_activations_kernel`), so the same bytes and scales. Columns from N on are not stored."""
    groups = tl.reshape(y, (GROUPS, 128))
    scale = tl.maximum(tl.max(tl.abs(groups), axis=1), FLOOR) / 448.0
    q = tl.minimum(tl.maximum(tl.math.div_rn(groups, scale[:, None]), -448.0), 448.0)
    cols = first + tl.arange(0, GROUPS)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=cols < N)
    group = first // 128 + tl.arange(0, GROUPS)
    tl.store(s_ptr + group, scale, mask=group * 128 < N)


@triton.jit
def chunk_count(keys, SPLIT: tl.constexpr, LEAD: tl.constexpr, LEAD_SPLIT: tl.constexpr):  # noqa: N803
    """How many split-KV chunks hold keys [0, keys): LEAD_SPLIT-key ones up to key LEAD, then SPLIT-key ones
    (`paged_attention.SplitKvPlan`)."""
    return tl.cdiv(tl.minimum(keys, LEAD), LEAD_SPLIT) + tl.cdiv(tl.maximum(keys - LEAD, 0), SPLIT)


@triton.jit
def chunk_keys(chunk, SPLIT: tl.constexpr, LEAD: tl.constexpr, LEAD_SPLIT: tl.constexpr):  # noqa: N803
    """Split-KV chunk `chunk`'s keys [start, stop), a function of its index alone (`chunk_count`'s cut)."""
    leading: tl.constexpr = LEAD // LEAD_SPLIT
    start = tl.where(chunk < leading, chunk * LEAD_SPLIT, LEAD + (chunk - leading) * SPLIT)
    return start, start + tl.where(chunk < leading, LEAD_SPLIT, SPLIT)


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
def attend_block_log2(q, k, v, visible, MASKED: tl.constexpr, qk_scale, m, denom, acc, INTERPRETED: tl.constexpr,  # noqa: N803
                      PRECISION: tl.constexpr):  # noqa: N803  # fmt: skip
    """`attend_block` in base 2, for the compute-bound prefill: `qk_scale` is the softmax scale times log2(e) and m
    the running maximum in those units, so a score costs one FMA and one `ex2` (`tl.exp` is a multiply and an
    `ex2`). MASKED=False: every key of the block is visible to every row (no select). Same contract otherwise: a
    row's numbers depend on its own query and keys and on the block order only."""
    scores = dot(q, tl.trans(k), INTERPRETED, PRECISION)
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1) * qk_scale)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    alpha = tl.exp2(m - m_new)
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


# The sampler's filter threshold (`ops/sampling.py`): its constants come from there, once.
_LOG2E = tl.constexpr(_sampling.LOG2E)
_LN2_HI = tl.constexpr(_sampling.LN2_HI)
_LN2_LO = tl.constexpr(_sampling.LN2_LO)
_E0, _E1, _E2, _E3, _E4, _E5 = (tl.constexpr(c) for c in _sampling.EXP_POLYNOMIAL)
_MASS_SHIFT = tl.constexpr(_sampling.MASS_BITS - 24)
_LEVELS = tl.constexpr(_sampling.MASS_LEVELS)


@triton.jit
def order_key(x):
    """fp32 x -> int64 key in [0, 2^32) that orders as x does (-0.0 keyed as +0.0): a negative float's other bits
    flipped, then offset by 2^31 (`sampling.order_key`)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) - (-2147483648)


@triton.jit
def key_value(top, SHIFT: tl.constexpr):  # noqa: N803
    """The fp32 value whose order key has the high bits `top` (int64; the key >> SHIFT): `order_key`'s inverse. With
    SHIFT = 16 (bf16 values) the low bits are the sign's fill: 0 below a positive value's key, ones below a
    negative's."""
    key = top << SHIFT
    if SHIFT > 0:
        key = key | tl.where((key >> 31) != 0, 0, (1 << SHIFT) - 1)
    signed = (key + (-2147483648)).to(tl.int32)
    return (signed ^ ((signed >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def mass_exponent(x, row_max, inv_t):
    """y = max((x - max) / T, -45) and n = round(y / ln 2), the power of two of x's fixed-point mass (fp32, both
    computed as `sampling.fixed_point_mass` does)."""
    y = tl.maximum((x - row_max) * inv_t, -45.0)
    return y, tl.floor(y * _LOG2E + 0.5)


@triton.jit
def mass_level(x, row_max, inv_t):
    """x's level (int32 in [0, MASS_LEVELS)): -n of `mass_exponent`, the last level holding every lower one. It
    never rises as x falls, and a token of level l weighs less than 2^(MASS_BITS + 1 - l) (`sampling`)."""
    _, n = mass_exponent(x, row_max, inv_t)
    return tl.minimum(-n, _LEVELS - 1).to(tl.int32)


@triton.jit
def fixed_point_mass(x, row_max, inv_t):
    """`sampling.fixed_point_mass`: the same fp32 operations in the same order (kernels calling it are launched
    with `enable_fp_fusion=False`, so no product is contracted into an FMA), hence the same int64 masses."""
    y, n = mass_exponent(x, row_max, inv_t)
    r = (y - n * _LN2_HI) - n * _LN2_LO
    p = ((((r * _E0 + _E1) * r + _E2) * r + _E3) * r + _E4) * r + _E5
    p = p * (r * r) + r + 1.0
    whole = (p * 16777216.0).to(tl.int64)
    shift = n.to(tl.int64) + _MASS_SHIFT
    return tl.where(shift >= 0, whole << tl.maximum(shift, 0), whole >> tl.maximum(-shift, 0))


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
