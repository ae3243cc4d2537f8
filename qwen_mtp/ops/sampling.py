"""The sampler's device ops: a Gumbel-max choice per row with counter-based noise (`sample_tokens`), and the
filters' logit threshold (`filter_threshold`: top-k, top-p, min-p, without sorting the vocabulary); plain-torch
references beside their Triton kernels.

Noise. The Gumbel variable of token v in row r is a pure function of (seed_r, position_r, v): a 32-bit integer
hash (two rounds of the `lowbias32` finalizer, keyed by the seed's two halves and the position), its top 24 bits
as u in (0, 1), then g = -log(-log(u)). The integer part is bit-identical in torch (int64 arithmetic kept under
2^63) and in Triton (uint32); the two logs may round an ulp apart between the CPU and the GPU. Nothing of a row
depends on another row, nor on how many rows there are: rows are independent programs, and a row's reductions run
in fixed chunks of `BLOCK` tokens combined in chunk order (so the log-sum-exp is batch-invariant too).

Choice. score_v = logit_v * inv_temperature + g_v where logit_v >= threshold (else -inf); the token is the first
index of the maximal score. A row with inv_temperature 0 is greedy: the first index of the maximal logit, as
`torch.argmax`. The log-sum-exp of the raw logits (the temperature-1 normaliser logprobs need) comes from the same
pass.

Threshold. The reference sorts a row and reads tau off the sorted order (the definition); the kernels find the
same value from histograms, without a sort: of the 2^16 values a bf16 logit can take (counts), or radix selects
over the logits' order keys (float bits, sign-flipped so that they compare as integers), 4 bits a step. Masses are
fixed-point integers, so every sum is exact whatever order adds it: the kernels equal the reference bit for bit
and a row's tau never depends on the other rows.
"""

from __future__ import annotations

import functools
import struct

import torch

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced

BLOCK = 4096  # tokens per program: a row of 248k tokens runs as 61 programs, combined in chunk order
_M32 = 0xFFFFFFFF
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers (C. Wellons' hash prospector)
_SALT_A, _SALT_B = 0x9E3779B9, 0x85EBCA6B


# ---- plain-torch reference (int64 tensors holding uint32 values) ----------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for 0 <= x < 2^32, every intermediate below 2^49 (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit keys of each row [R] from its seed (in [0, 2^63)) and the position it samples."""
    low, high = seed & _M32, (seed >> 32) & _M32
    key_a = _mix32(low ^ _mix32((position & _M32) ^ _SALT_A))
    return key_a, _mix32(high ^ _mix32(key_a ^ _SALT_B))


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1) for every (row, token) [R, V], from 24 hash bits: the counter-based generator itself."""
    key_a, key_b = row_keys(seed.long(), position.long())
    tokens = torch.arange(vocab, dtype=torch.long, device=seed.device)
    bits = _mix32(_mix32(tokens[None, :] ^ key_a[:, None]) ^ key_b[:, None])
    return ((bits >> 8).float() + 0.5) * 2.0**-24


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """g(seed, position, v) [R, V]: standard Gumbel noise."""
    return -torch.log(-torch.log(uniform_noise(seed, position, vocab)))


def sample_tokens_reference(
    logits: torch.Tensor,  # [R, V]
    inv_temperature: torch.Tensor,  # [R] float32; 0: greedy
    threshold: torch.Tensor | None,  # [R] float32: tokens with a smaller logit are filtered out; None: none are
    seed: torch.Tensor,  # [R] long
    position: torch.Tensor,  # [R] long
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [R] (long) and the log-sum-exp of the raw logits [R] (float32)."""
    rows, vocab = logits.shape
    x = logits.float()
    scores = x * inv_temperature[:, None] + gumbel_noise(seed, position, vocab)
    if threshold is not None:
        scores = torch.where(x >= threshold[:, None], scores, float("-inf"))
    scores = torch.where(inv_temperature[:, None] > 0, scores, x)
    tokens = scores.argmax(dim=-1)
    chunks = -(-vocab // block)
    padded = torch.full((rows, chunks * block), float("-inf"), device=x.device)
    padded[:, :vocab] = x
    padded = padded.view(rows, chunks, block)
    chunk_max = padded.amax(dim=-1)  # [R, C]
    chunk_sum = torch.exp(padded - chunk_max[..., None]).sum(dim=-1)
    top = chunk_max.amax(dim=-1)
    lse = top + torch.log((chunk_sum * torch.exp(chunk_max - top[:, None])).sum(dim=-1))
    return tokens, lse


def _fp32(value: float) -> float:
    """`value` rounded to float32, so that torch and Triton multiply by the very same constant."""
    return struct.unpack("f", struct.pack("f", value))[0]


# Filter thresholds. Masses are fixed-point integers so that every sum is exact: a row's histograms and prefix sums
# are the same whatever order (chunks, lanes, programs) adds them, which makes the kernel equal the reference bit
# for bit and a row's threshold independent of the other rows.
MASS_BITS = 42  # the most likely token weighs 2^42: V * 2^42 < 2^63 for a vocabulary of up to 2^20 tokens
MAX_VOCAB = 1 << 20
LOG2E = _fp32(1.4426950408889634)
LN2_HI, LN2_LO = 0.693359375, _fp32(-2.12194440e-4)  # ln 2 in two parts; n * LN2_HI is exact for |n| < 2^15
# e^r on [-ln2/2, ln2/2]: Cephes' expf polynomial (about 1 ulp), highest coefficient first
EXP_POLYNOMIAL = tuple(_fp32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                1.6666665459e-1, 5.0000001201e-1))  # fmt: skip


def fixed_point_mass(x: torch.Tensor, row_max: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """floor(exp((x - max) / T) * 2^MASS_BITS) [R, V] (int64) for fp32 logits x [R, V] (finite or -inf).

    Why not `torch.exp`: the kernel must compute the same integers, and exp rounds differently in torch, numpy and
    Triton. So exp(y) = 2^n e^r, n = round(y / ln 2), r = y - n ln 2 (Cody and Waite's two-part ln 2), e^r a
    polynomial with one rounding per product and per sum (fp32 mul and add round alike everywhere when the kernel
    does not contract them into FMAs), 2^n an integer shift: as accurate as `torch.exp` of the rounded y. Masses
    below 2^-MASS_BITS of the most likely token's are 0 (together under V * 2^-42 ~ 6e-8 of the row's mass)."""
    y = torch.clamp((x - row_max[:, None]) * inv_temperature[:, None], min=-45.0)  # e^-45 is 0 at 42 bits; -inf too
    n = torch.floor(y * LOG2E + 0.5)
    r = (y - n * LN2_HI) - n * LN2_LO
    p = r * EXP_POLYNOMIAL[0] + EXP_POLYNOMIAL[1]
    for c in EXP_POLYNOMIAL[2:]:
        p = p * r + c
    p = p * (r * r) + r + 1.0
    whole = (p * 16777216.0).long()  # p in [0.7, 1.42): 24 significant bits, an integer times 2^-24
    shift = n.long() + (MASS_BITS - 24)
    return torch.where(shift >= 0, whole << shift.clamp(min=0), whole >> (-shift).clamp(min=0))


def value_keys(values: torch.Tensor) -> torch.Tensor:
    """The 16-bit order key (long) of bf16 values, the index of their value counts (the kernels' `order_key` >> 16):
    a negative value's bits flipped, a positive one's sign bit set, -0.0 keyed as +0.0."""
    bits = values.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    bits = torch.where(bits == 0x8000, 0, bits)
    return torch.where(bits >= 0x8000, 0x7FFF - (bits & 0x7FFF), bits | 0x8000)


def filter_threshold_reference(
    logits: torch.Tensor,  # [R, V] float32 or bfloat16
    keep: torch.Tensor,  # [R] long in [1, V]: top-k's k (V: no top-k)
    inv_temperature: torch.Tensor,  # [R] float32 (0: greedy, no top-p)
    top_p: torch.Tensor,  # [R] float32 in (0, 1] (1: no top-p)
    min_p_offset: torch.Tensor,  # [R] float32: T * ln(min_p) (-inf: no min-p)
) -> torch.Tensor:
    """tau [R] (float32): the smallest logit the filters keep, each row's kept set being {v : logit_v >= tau}
    (tokens tied with the last kept one are kept: a threshold is a value); -inf for a row without filters.

    The definition, on a sorted row (the kernel finds the same tau without sorting):
    - top-k: tau_k = the k-th largest logit (-inf when k = V);
    - top-p, over the top-k set {logit >= tau_k} with masses q_v = `fixed_point_mass` (exact integers):
      tau_p = the largest logit l with Q(l) >= top_p * total, Q(l) the mass of the tokens with logit >= l and
      total the mass of the set (the product in float64): the smallest set of most likely tokens, ties kept
      together, whose mass reaches top_p (-inf when top_p = 1 or the row is greedy);
    - min-p: tau_m = max logit + T ln(min_p) (p >= min_p * p_max).
    tau = max(tau_k, tau_p, tau_m)."""
    x = logits.float()
    vocab = x.shape[-1]
    ordered = x.sort(dim=-1, descending=True).values
    row_max = ordered[:, 0]
    none = torch.full_like(row_max, float("-inf"))
    by_k = torch.where(keep < vocab, ordered.gather(1, (keep.clamp(1, vocab) - 1)[:, None])[:, 0], none)
    mass = torch.where(ordered >= by_k[:, None], fixed_point_mass(ordered, row_max, inv_temperature), 0)
    target = top_p.double() * mass.sum(dim=-1).double()
    reached = torch.cumsum(mass, dim=-1).double() >= target[:, None]  # Q at each token's tie group (sorted order)
    first = reached.int().argmax(dim=-1)  # the first token where it reaches the target: its value is tau_p
    by_p = torch.where((top_p < 1.0) & (inv_temperature > 0), ordered.gather(1, first[:, None])[:, 0], none)
    return torch.maximum(torch.maximum(by_k, by_p), row_max + min_p_offset)


# ---- Triton -----------------------------------------------------------------------------------------------------
@functools.cache  # build (and let Triton cache) the kernels once, on first use
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partials(
        logits_ptr, stride, vocab, inv_t_ptr, threshold_ptr, seed_ptr, position_ptr,
        best_ptr, index_ptr, max_ptr, sum_ptr, chunks,
        FILTERED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        row, chunk = tl.program_id(0), tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        valid = offs < vocab
        x = tl.load(logits_ptr + row * stride + offs, mask=valid, other=0.0).to(tl.float32)
        inv_t = tl.load(inv_t_ptr + row)
        seed = tl.load(seed_ptr + row)
        position = tl.load(position_ptr + row)
        low = (seed & 0xFFFFFFFF).to(tl.uint32)
        high = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key_a = triton_utils.mix32(low ^ triton_utils.mix32((position & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9))
        key_b = triton_utils.mix32(high ^ triton_utils.mix32(key_a ^ 0x85EBCA6B))
        bits = triton_utils.mix32(triton_utils.mix32(offs.to(tl.uint32) ^ key_a) ^ key_b)
        u = ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
        noisy = x * inv_t + -tl.log(-tl.log(u))
        if FILTERED:
            noisy = tl.where(x >= tl.load(threshold_ptr + row), noisy, float("-inf"))
        x = tl.where(valid, x, float("-inf"))  # (loaded as 0 so that x * 0 stays a number past the row's end)
        scores = tl.where(valid, tl.where(inv_t > 0, noisy, x), float("-inf"))
        best = tl.max(scores, axis=0)
        first = tl.argmax(scores, axis=0, tie_break_left=True)
        top = tl.max(x, axis=0)
        total = tl.sum(tl.where(valid, tl.exp(x - top), 0.0), axis=0)
        out = row * chunks + chunk
        tl.store(best_ptr + out, best)
        tl.store(index_ptr + out, chunk * BLOCK + first)
        tl.store(max_ptr + out, top)
        tl.store(sum_ptr + out, total)

    @triton.jit
    def combine(
        best_ptr, index_ptr, max_ptr, sum_ptr, tokens_ptr, lse_ptr, chunks, BLOCK_C: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_C)
        valid = offs < chunks
        best = tl.load(best_ptr + row * chunks + offs, mask=valid, other=float("-inf"))
        first = tl.argmax(best, axis=0, tie_break_left=True)  # chunks in token order: the first maximal token
        tl.store(tokens_ptr + row, tl.load(index_ptr + row * chunks + first).to(tl.int64))
        top = tl.load(max_ptr + row * chunks + offs, mask=valid, other=float("-inf"))
        total = tl.load(sum_ptr + row * chunks + offs, mask=valid, other=0.0)
        overall = tl.max(top, axis=0)
        tl.store(lse_ptr + row, overall + tl.log(tl.sum(tl.where(valid, total * tl.exp(top - overall), 0.0), axis=0)))

    return partials, combine


def sample_tokens_triton(logits, inv_temperature, threshold, seed, position, block: int = BLOCK):
    """Triton version of `sample_tokens_reference` (same arguments and results)."""
    import triton

    partials, combine = _kernels()
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    # the kernels read row r's parameters at offset r: a per-request value expanded over its verify rows is a
    # stride-0 view (one request's [1, K+1] rows flatten to one), so it is laid out one per row first
    inv_temperature, seed, position = (t.contiguous() for t in (inv_temperature, seed, position))
    threshold = None if threshold is None else threshold.contiguous()
    chunks = triton.cdiv(vocab, block)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    top, total = torch.empty_like(best), torch.empty_like(best)
    filtered = threshold is not None
    partials[(rows, chunks)](
        logits, logits.stride(0), vocab, inv_temperature, threshold if filtered else inv_temperature,
        seed, position, best, index, top, total, chunks,
        FILTERED=filtered, BLOCK=block,
        **triton_utils.launch(logits.device, fp_fusion=False),  # no FMA: the reference rounds the product first
    )  # fmt: skip
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    combine[(rows,)](
        best, index, top, total, tokens, lse, chunks, BLOCK_C=max(2, triton.next_power_of_2(chunks)),
        **triton_utils.launch(best.device),
    )  # fmt: skip
    return tokens, lse


@functools.cache  # as `_kernels`
def _radix_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def radix_histogram(
        logits_ptr, stride, vocab, active_ptr, row_max_ptr, inv_t_ptr, floor_ptr, prefix_ptr, hist_ptr, chunks,
        SHIFT: tl.constexpr, MASS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """Partial histograms [R, chunks, 2^BITS] (int64) of one chunk of a row: the mass (MASS) or the count of its
        tokens whose key's bits above SHIFT + BITS equal the row's prefix, binned by their next BITS bits."""
        triton_utils.wait_for_previous_kernel(PDL)
        row, chunk = tl.program_id(0), tl.program_id(1)
        if tl.load(active_ptr + row):
            bins = tl.arange(0, 1 << BITS)
            prefix = tl.load(prefix_ptr + row)
            row_max = tl.load(row_max_ptr + row)
            inv_t = tl.load(inv_t_ptr + row)
            floor = tl.load(floor_ptr + row)
            lanes = tl.zeros([SUB, 1 << BITS], dtype=tl.int64)  # integer sums: exact in any order
            for start in range(0, BLOCK, SUB):
                offs = chunk * BLOCK + start + tl.arange(0, SUB)[:, None]  # [SUB, 1]: the lanes' layout, no shuffles
                valid = offs < vocab
                x = tl.load(logits_ptr + row * stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
                key = triton_utils.order_key(x)
                inside = valid & ((key >> (SHIFT + BITS)) == prefix)
                if MASS:
                    mass = triton_utils.fixed_point_mass(x, row_max, inv_t)
                    weight = tl.where(inside & (x >= floor), mass, 0)
                else:
                    weight = inside.to(tl.int64)
                digit = ((key >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
                lanes += tl.where(digit == bins[None, :], weight, 0)
            tl.store(hist_ptr + (row * chunks + chunk) * (1 << BITS) + bins, tl.sum(lanes, axis=0))

    @triton.jit
    def radix_select(
        hist_ptr, chunks, active_ptr, goal_ptr, prefix_ptr, above_ptr, target_ptr, out_ptr,
        SHIFT: tl.constexpr, MASS: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
        BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """One row's radix step: the highest bin whose tokens and those above it reach the target (k tokens, or
        top_p of the set's mass); its digit joins the prefix, the mass (count) of the bins above it joins `above`.
        The last step writes the threshold: the logit whose key is the prefix (-inf for inactive rows)."""
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        if tl.load(active_ptr + row):
            bins = tl.arange(0, 1 << BITS)
            c = tl.arange(0, BLOCK_C)
            parts = tl.load(
                hist_ptr + (row * chunks + c[:, None]) * (1 << BITS) + bins[None, :], mask=c[:, None] < chunks, other=0
            )
            hist = tl.sum(parts, axis=0)  # [2^BITS]
            if FIRST:
                prefix = tl.zeros([], dtype=tl.int64)
                above = tl.zeros([], dtype=tl.int64)
                if MASS:  # the first histogram holds the whole set: its mass is the total
                    target = tl.load(goal_ptr + row).to(tl.float64) * tl.sum(hist, axis=0).to(tl.float64)
                else:
                    target = tl.load(goal_ptr + row).to(tl.float64)
            else:
                prefix = tl.load(prefix_ptr + row)
                above = tl.load(above_ptr + row)
                target = tl.load(target_ptr + row)
            at_least = above + tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0), axis=1)
            digit = tl.max(tl.where(at_least.to(tl.float64) >= target, bins, 0), axis=0)
            above += tl.sum(tl.where(bins > digit, hist, 0), axis=0)
            prefix = prefix * (1 << BITS) + digit
            if LAST:
                tl.store(out_ptr + row, triton_utils.key_value(prefix, SHIFT))
            else:
                tl.store(prefix_ptr + row, prefix)
                tl.store(above_ptr + row, above)
                tl.store(target_ptr + row, target)
        elif LAST:
            tl.store(out_ptr + row, float("-inf"))

    return radix_histogram, radix_select


@functools.cache  # as `_kernels`
def _count_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def level_counts(
        logits_ptr, stride, vocab, keep_ptr, inv_t_ptr, top_p_ptr, row_max_ptr, levels_ptr, mass_ptr, chunks,
        BLOCK: tl.constexpr, LEVELS: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """Partial counts [R, chunks, LEVELS] (int32) of one chunk of a bf16 row's tokens by level
        (`triton_utils.mass_level`, at T = 1 for a greedy row) and, for a row with top-p and no top-k, the chunk's
        fixed-point mass [R, chunks] (int64: exact in any order)."""
        triton_utils.wait_for_previous_kernel(PDL)
        row, chunk = tl.program_id(0), tl.program_id(1)
        keep = tl.load(keep_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        top_p_on = (tl.load(top_p_ptr + row) < 1.0) & (inv_t > 0.0)
        if (keep < vocab) | top_p_on:
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            valid = offs < vocab
            x = tl.load(logits_ptr + row * stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
            row_max = tl.load(row_max_ptr + row)
            level = triton_utils.mass_level(x, row_max, tl.where(inv_t > 0.0, inv_t, 1.0))
            levels = tl.arange(0, LEVELS)
            past_end = tl.where(levels == LEVELS - 1, BLOCK - tl.sum(valid.to(tl.int32), axis=0), 0)  # -inf there
            tl.store(levels_ptr + (row * chunks + chunk) * LEVELS + levels, tl.histogram(level, LEVELS) - past_end)
            if top_p_on & (keep >= vocab):
                mass = tl.where(valid, triton_utils.fixed_point_mass(x, row_max, inv_t), 0)
                tl.store(mass_ptr + row * chunks + chunk, tl.sum(mass, axis=0))

    @triton.jit
    def count_window(
        levels_ptr, mass_ptr, chunks, vocab, keep_ptr, inv_t_ptr, top_p_ptr, row_max_ptr, window_ptr, low_ptr,
        total_ptr, counts_ptr, BLOCK_C: tl.constexpr, LEVELS: tl.constexpr, MASS_BITS: tl.constexpr,
        ZERO: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """One row's window: the lowest level whose tokens (with those of every level above) surely hold the
        threshold, so that only they need value counts (-1: a row without top-k or top-p). With top-k, the level
        where the count reaches k (top-p's threshold is never below top-k's, and the top-k set's mass comes from
        the counts). Top-p alone: the row's exact mass (stored in `total`) less a bound on the levels below (a
        token of level l weighs under 2^(MASS_BITS + 1 - l)), with a margin of 2^-40 for float64's rounding,
        reaches top_p of it. Zeroes the row's counts from `low`, a value below every token of the window, up to its
        largest value (the others are never read)."""
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        keep = tl.load(keep_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        window = tl.full([], -1, dtype=tl.int32)
        if (keep < vocab) | ((top_p < 1.0) & (inv_t > 0.0)):
            c = tl.arange(0, BLOCK_C)[:, None]
            levels = tl.arange(0, LEVELS)
            if keep < vocab:
                parts = tl.load(levels_ptr + (row * chunks + c) * LEVELS + levels[None, :], mask=c < chunks, other=0)
                reach = tl.cumsum(tl.sum(parts, axis=0).to(tl.int64), axis=0)  # tokens at this level or above
                window = tl.min(tl.where(reach >= keep, levels, LEVELS - 1), axis=0)
            else:
                lowest_first = LEVELS - 1 - levels
                parts = tl.load(
                    levels_ptr + (row * chunks + c) * LEVELS + lowest_first[None, :], mask=c < chunks, other=0
                )
                weight = tl.where(
                    lowest_first <= MASS_BITS + 1,
                    tl.full([LEVELS], 1, dtype=tl.int64) << tl.maximum(MASS_BITS + 1 - lowest_first, 0).to(tl.int64),
                    0,
                )
                # below[i]: bound on the mass of levels LEVELS - 1 .. LEVELS - 1 - i, all but those of window
                # LEVELS - 2 - i (a sum of exact non-negative terms: its rounding is relative to it)
                below = tl.cumsum(tl.sum(parts, axis=0).to(tl.float64) * weight.to(tl.float64), axis=0)
                each = tl.arange(0, BLOCK_C)
                total = tl.sum(tl.load(mass_ptr + row * chunks + each, mask=each < chunks, other=0), axis=0)
                tl.store(total_ptr + row, total)
                whole = total.to(tl.float64)
                target = top_p.to(tl.float64) * whole
                margin = 9.094947017729282e-13  # 2^-40
                sure = (whole - whole * margin - (below + below * margin) >= target) & (levels < LEVELS - 1)
                window = tl.min(tl.where(sure, LEVELS - 2 - levels, LEVELS - 1), axis=0)
            row_max = tl.load(row_max_ptr + row)
            top = (triton_utils.order_key(row_max) >> 16).to(tl.int32)
            low = tl.zeros([], dtype=tl.int32)
            if window < LEVELS - 1:
                # a token of level <= window has (x - max) / T >= -(window + 1/2) ln 2 (up to fp32 rounding): one
                # more level of margin, and one bf16 value less for the rounding of `floor` itself
                scale = tl.where(inv_t > 0.0, inv_t, 1.0)
                floor = row_max - (window.to(tl.float32) + 1.5) * 0.6931472 / scale
                low = tl.maximum((triton_utils.order_key(floor) >> 16).to(tl.int32) - 1, 0)
            tl.store(low_ptr + row, low)
            for start in range(low // ZERO * ZERO, top + 1, ZERO):
                tl.store(counts_ptr + row * 65536 + start + tl.arange(0, ZERO), tl.zeros([ZERO], dtype=tl.int32))
        tl.store(window_ptr + row, window)

    @triton.jit
    def value_counts(
        logits_ptr, stride, vocab, inv_t_ptr, row_max_ptr, window_ptr, counts_ptr, BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """counts [R, 2^16] (int32) += how many of one chunk's tokens in the row's window hold each value (the top
        16 bits of its order key). Integer atomics: the counts are exact whatever order adds them."""
        triton_utils.wait_for_previous_kernel(PDL)
        row, chunk = tl.program_id(0), tl.program_id(1)
        window = tl.load(window_ptr + row)
        if window >= 0:
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            valid = offs < vocab
            x = tl.load(logits_ptr + row * stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
            inv_t = tl.load(inv_t_ptr + row)
            level = triton_utils.mass_level(x, tl.load(row_max_ptr + row), tl.where(inv_t > 0.0, inv_t, 1.0))
            value = triton_utils.order_key(x) >> 16
            tl.atomic_add(counts_ptr + row * 65536 + value, 1, mask=valid & (level <= window), sem="relaxed")

    @triton.jit
    def block_sums(
        counts_ptr, inv_t_ptr, top_p_ptr, row_max_ptr, window_ptr, low_ptr, block_count_ptr, block_mass_ptr,
        BLOCKS: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """A block of BINS values of a row's counts: their count and (top-p) mass [R, BLOCKS] (int64); 0 outside
        the counted values (from the row's `low` to its largest)."""
        triton_utils.wait_for_previous_kernel(PDL)
        row, block = tl.program_id(0), tl.program_id(1)
        row_max = tl.load(row_max_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        top = triton_utils.order_key(row_max) >> 16
        count_sum = tl.zeros([], dtype=tl.int64)
        mass_sum = tl.zeros([], dtype=tl.int64)
        low = tl.load(low_ptr + row)  # (any number where the window is -1)
        if (tl.load(window_ptr + row) >= 0) & (block * BINS <= top) & (block * BINS + BINS > low):
            values = block * BINS + tl.arange(0, BINS)
            counted = (values >= low) & (values <= top)
            count = tl.load(counts_ptr + row * 65536 + values, mask=counted, other=0).to(tl.int64)
            count_sum = tl.sum(count, axis=0)
            if (tl.load(top_p_ptr + row) < 1.0) & (inv_t > 0.0) & (count_sum > 0):
                x = tl.where(count > 0, triton_utils.key_value(values.to(tl.int64), 16), row_max)  # (no NaNs)
                mass_sum = tl.sum(count * triton_utils.fixed_point_mass(x, row_max, inv_t), axis=0)
        tl.store(block_count_ptr + row * BLOCKS + block, count_sum)
        tl.store(block_mass_ptr + row * BLOCKS + block, mass_sum)

    @triton.jit
    def counted_threshold(
        counts_ptr, block_count_ptr, block_mass_ptr, low_ptr, total_ptr, vocab, keep_ptr, inv_t_ptr, top_p_ptr,
        min_p_ptr, row_max_ptr, tau_ptr, BLOCKS: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        """One bf16 row's tau from its counts, largest values first: top-k's value, where the count at or above it
        reaches k, then top-p's, where the mass at or above it (over the top-k set) reaches top_p of the set's;
        each found as the block where the block sums reach the target, then the value inside that block."""
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        keep = tl.load(keep_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        row_max = tl.load(row_max_ptr + row)
        top = triton_utils.order_key(row_max) >> 16
        low = tl.load(low_ptr + row)  # (any number where no filter is on: then unread)
        counts = counts_ptr + row * 65536
        order = tl.arange(0, BLOCKS)
        blocks = BLOCKS - 1 - order  # largest values first
        lanes = tl.arange(0, BINS)
        by_k = tl.full([], float("-inf"), dtype=tl.float32)
        by_p = tl.full([], float("-inf"), dtype=tl.float32)
        key_k = tl.full([], -1, dtype=tl.int64)  # top-k's value (its 16-bit key); -1: no top-k
        block_k = tl.full([], -1, dtype=tl.int32)
        if keep < vocab:
            count = tl.load(block_count_ptr + row * BLOCKS + blocks)
            reach = tl.cumsum(count, axis=0)
            at = tl.min(tl.where(reach >= keep, order, BLOCKS - 1), axis=0)
            above = tl.sum(tl.where(order < at, count, 0), axis=0)
            block_k = BLOCKS - 1 - at
            values = block_k * BINS + BINS - 1 - lanes
            count = tl.load(counts + values, mask=(values >= low) & (values <= top), other=0).to(tl.int64)
            inner = above + tl.cumsum(count, axis=0)
            key_k = (block_k * BINS + BINS - 1 - tl.min(tl.where(inner >= keep, lanes, BINS - 1), axis=0)).to(tl.int64)
            by_k = triton_utils.key_value(key_k, 16)
        if (top_p < 1.0) & (inv_t > 0.0):
            mass = tl.load(block_mass_ptr + row * BLOCKS + blocks)
            if keep < vocab:  # the top-k set: the blocks above top-k's, and its own from top-k's value up
                values = block_k * BINS + BINS - 1 - lanes
                count = tl.load(counts + values, mask=(values >= low) & (values <= top), other=0).to(tl.int64)
                x = tl.where(count > 0, triton_utils.key_value(values.to(tl.int64), 16), row_max)
                own = tl.where(values >= key_k, count * triton_utils.fixed_point_mass(x, row_max, inv_t), 0)
                mass = tl.where(blocks > block_k, mass, tl.where(blocks == block_k, tl.sum(own, axis=0), 0))
                total = tl.sum(mass, axis=0)
            else:  # the whole row's, of which the counts hold the window
                total = tl.load(total_ptr + row)
            target = top_p.to(tl.float64) * total.to(tl.float64)
            reach = tl.cumsum(mass, axis=0)
            at = tl.min(tl.where(reach.to(tl.float64) >= target, order, BLOCKS - 1), axis=0)
            above = tl.sum(tl.where(order < at, mass, 0), axis=0)
            block_p = BLOCKS - 1 - at
            values = block_p * BINS + BINS - 1 - lanes
            count = tl.load(counts + values, mask=(values >= low) & (values <= top), other=0).to(tl.int64)
            x = tl.where(count > 0, triton_utils.key_value(values.to(tl.int64), 16), row_max)
            inner = above + tl.cumsum(
                tl.where(values >= key_k, count * triton_utils.fixed_point_mass(x, row_max, inv_t), 0), axis=0
            )
            first = tl.min(tl.where(inner.to(tl.float64) >= target, lanes, BINS - 1), axis=0)
            by_p = triton_utils.key_value((block_p * BINS + BINS - 1 - first).to(tl.int64), 16)
        tl.store(tau_ptr + row, tl.maximum(tl.maximum(by_k, by_p), row_max + tl.load(min_p_ptr + row)))

    return level_counts, count_window, value_counts, block_sums, counted_threshold


RADIX_BITS = 4  # key bits a radix step settles: 16 bins; 4 steps for 16-bit keys, 8 for 32-bit ones
RADIX_BLOCK, RADIX_SUB = 2048, 128  # tokens per program (122 programs a row at 248k), tokens per inner step
MASS_LEVELS = 64  # levels of a token's mass exponent (`triton_utils.mass_level`): which tokens need value counts
COUNTS_BINS = 1024  # values per block of a row's 2^16 value counts: 64 blocks, summed in parallel
COUNTS_ZERO = 4096  # counts zeroed per store


def filter_threshold_triton(
    logits, keep, inv_temperature, top_p, min_p_offset, block: int = RADIX_BLOCK, method: str | None = None
):
    """Triton version of `filter_threshold_reference` (same arguments, the same tau bit for bit), with no sort.

    `method` "counts" (bf16 logits; their default): a bf16 logit has 2^16 possible values, so tau comes from how
    many tokens hold each value, counted only for the tokens that can matter (`_counted_threshold`). "radix" (any
    dtype; the default for fp32): two radix selects over the order keys, top-k's on counts, then top-p's on the
    masses of the top-k set, 4 bits a step, each step a histogram of the row in parallel chunks (`radix_histogram`,
    int64 partials) and one program a row picking the bin (`radix_select`). Either way every sum is of integers,
    exact in any order, and a row's work depends on nothing but its row."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB:
        raise ValueError(
            f"filter_threshold: a vocabulary of {vocab} tokens; the fixed-point masses hold up to {MAX_VOCAB}"
        )
    method = method or ("counts" if logits.dtype == torch.bfloat16 else "radix")
    if method not in ("counts", "radix") or (method == "counts" and logits.dtype != torch.bfloat16):
        raise ValueError(
            f"filter_threshold: method {method!r} for {logits.dtype} logits; use 'radix' (or 'counts' for bf16)"
        )
    assert logits.stride(1) == 1
    # the kernels read row r's parameters at offset r (a verify's rows see one request's values as stride-0 views)
    keep, inv_temperature, top_p, min_p_offset = (t.contiguous() for t in (keep, inv_temperature, top_p, min_p_offset))
    row_max = logits.amax(dim=-1).float()
    if method == "counts":
        return _counted_threshold(logits, keep, inv_temperature, top_p, min_p_offset, row_max, block)
    by_k, by_p = _radix_thresholds(logits, keep, inv_temperature, top_p, row_max, block)
    return torch.maximum(torch.maximum(by_k, by_p), row_max + min_p_offset)


def _counted_threshold(logits, keep, inv_temperature, top_p, min_p_offset, row_max, block):
    """tau [R] of bf16 rows from their value counts, in five launches, each parallel over its rows:

    1. `level_counts` (chunks of a row): each token's level, the power of two of its mass (at T = 1 for greedy
       rows), counted per chunk; top-p alone: the chunk's exact mass too;
    2. `count_window` (a program a row): the window, the levels from the top that surely hold tau (top-k's count,
       or top-p's mass less a bound on the levels below), and the counts zeroed from a value below its tokens
       (`low`) up to the row's largest;
    3. `value_counts` (chunks): int32 atomics count how many of the window's tokens hold each of the 2^16 values,
       the only per-token atomics (a peaked row's window is a few hundred tokens; a flat one's the whole row);
    4. `block_sums` (blocks of 1024 values of a row): each block's count and mass;
    5. `counted_threshold` (a program a row): the block where the sums from the top reach k (or top_p of the total
       mass), then the value inside it; tau = max(top-k's, top-p's, max + T ln(min_p))."""
    _, _, _, block_sums, counted_threshold = _count_kernels()
    rows, vocab = logits.shape
    device = logits.device
    counts, window, low, total = _windowed_counts(logits, keep, inv_temperature, top_p, row_max, block)
    blocks = (1 << 16) // COUNTS_BINS
    block_count = torch.empty(rows, blocks, dtype=torch.int64, device=device)
    block_mass = torch.empty_like(block_count)
    block_sums[(rows, blocks)](
        counts, inv_temperature, top_p, row_max, window, low, block_count, block_mass,
        BLOCKS=blocks, BINS=COUNTS_BINS, **triton_utils.launch(device, fp_fusion=False),
    )  # fmt: skip
    tau = torch.empty(rows, dtype=torch.float32, device=device)
    counted_threshold[(rows,)](
        counts, block_count, block_mass, low, total, vocab, keep, inv_temperature, top_p, min_p_offset, row_max, tau,
        BLOCKS=blocks, BINS=COUNTS_BINS, **triton_utils.launch(device, fp_fusion=False),
    )  # fmt: skip
    return tau


def _windowed_counts(logits, keep, inv_temperature, top_p, row_max, block):
    """Steps 1-3 of `_counted_threshold`: the value counts [R, 2^16] (int32; valid from each row's `low` up to its
    largest value) of the window's tokens, the windows [R] (int32: the lowest level counted; -1: none), `low` [R]
    (int32: a value below every token of the window) and each top-p-alone row's exact mass [R] (int64)."""
    import triton

    level_counts, count_window, value_counts, _, _ = _count_kernels()
    rows, vocab = logits.shape
    device = logits.device
    chunks = triton.cdiv(vocab, block)
    levels = torch.empty(rows, chunks, MASS_LEVELS, dtype=torch.int32, device=device)
    chunk_mass = torch.empty(rows, chunks, dtype=torch.int64, device=device)
    level_counts[(rows, chunks)](
        logits, logits.stride(0), vocab, keep, inv_temperature, top_p, row_max, levels, chunk_mass, chunks,
        BLOCK=block, LEVELS=MASS_LEVELS,
        **triton_utils.launch(device, fp_fusion=False),  # no FMA: the reference rounds every product
    )  # fmt: skip
    window, low = (torch.empty(rows, dtype=torch.int32, device=device) for _ in range(2))
    total = torch.empty(rows, dtype=torch.int64, device=device)
    counts = torch.empty(rows, 1 << 16, dtype=torch.int32, device=device)
    count_window[(rows,)](
        levels, chunk_mass, chunks, vocab, keep, inv_temperature, top_p, row_max, window, low, total, counts,
        BLOCK_C=max(2, triton.next_power_of_2(chunks)), LEVELS=MASS_LEVELS, MASS_BITS=MASS_BITS, ZERO=COUNTS_ZERO,
        **triton_utils.launch(device),
    )  # fmt: skip
    value_counts[(rows, chunks)](
        logits, logits.stride(0), vocab, inv_temperature, row_max, window, counts, BLOCK=block,
        **triton_utils.launch(device, fp_fusion=False),  # the levels must be `level_counts`' to the bit
    )  # fmt: skip
    return counts, window, low, total


def _radix_thresholds(logits, keep, inv_temperature, top_p, row_max, block):
    """Top-k's and top-p's thresholds [R] by radix selects (see `filter_threshold_triton`)."""
    import triton

    histogram, select = _radix_kernels()
    rows, vocab = logits.shape
    key_bits = 16 if logits.dtype == torch.bfloat16 else 32
    chunks = triton.cdiv(vocab, block)
    hist = torch.empty(rows, chunks, 1 << RADIX_BITS, dtype=torch.int64, device=logits.device)
    prefixes = torch.zeros(2, rows, dtype=torch.int64, device=logits.device)  # the key bits settled so far
    above = torch.empty(rows, dtype=torch.int64, device=logits.device)
    target = torch.empty(rows, dtype=torch.float64, device=logits.device)
    by_k, by_p = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(2))
    none = torch.full_like(row_max, float("-inf"))
    selects = (
        (False, keep < vocab, keep, none, prefixes[0], by_k),  # top-k: counts over every token
        (True, (top_p < 1.0) & (inv_temperature > 0), top_p, by_k, prefixes[1], by_p),  # top-p: masses over top-k
    )
    steps = key_bits // RADIX_BITS
    for mass, active, goal, floor, prefix, out in selects:
        for step in range(steps):
            shift = 32 - RADIX_BITS * (step + 1)
            histogram[(rows, chunks)](
                logits, logits.stride(0), vocab, active, row_max, inv_temperature, floor, prefix, hist, chunks,
                SHIFT=shift, MASS=mass, BITS=RADIX_BITS, BLOCK=block, SUB=min(RADIX_SUB, block),
                **triton_utils.launch(logits.device, fp_fusion=False),  # no FMA: the reference rounds products
            )  # fmt: skip
            select[(rows,)](
                hist, chunks, active, goal, prefix, above, target, out,
                SHIFT=shift, MASS=mass, BITS=RADIX_BITS, FIRST=step == 0, LAST=step == steps - 1,
                BLOCK_C=max(2, triton.next_power_of_2(chunks)), **triton_utils.launch(hist.device),
            )  # fmt: skip
    return by_k, by_p


# ---- custom ops ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("qwen_mtp::sample_tokens", mutates_args=())
def sample_tokens(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    threshold: torch.Tensor | None,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: `sample_tokens_reference` on CPU, two Triton launches on CUDA."""
    return sample_tokens_reference(logits, inv_temperature, threshold, seed, position)


@cuda_kernel(sample_tokens)
def _(logits, inv_temperature, threshold, seed, position):
    if reference_forced("sample_tokens"):
        return sample_tokens_reference(logits, inv_temperature, threshold, seed, position)
    return sample_tokens_triton(logits, inv_temperature, threshold, seed, position)


@sample_tokens.register_fake
def _(logits, inv_temperature, threshold, seed, position):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("qwen_mtp::filter_threshold", mutates_args=())
def filter_threshold(
    logits: torch.Tensor,
    keep: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p_offset: torch.Tensor,
) -> torch.Tensor:
    """Custom op: `filter_threshold_reference` on CPU (a sort), `filter_threshold_triton` on CUDA (no sort)."""
    return filter_threshold_reference(logits, keep, inv_temperature, top_p, min_p_offset)


@cuda_kernel(filter_threshold)
def _(logits, keep, inv_temperature, top_p, min_p_offset):
    if reference_forced("filter_threshold"):
        return filter_threshold_reference(logits, keep, inv_temperature, top_p, min_p_offset)
    return filter_threshold_triton(logits, keep, inv_temperature, top_p, min_p_offset)


@filter_threshold.register_fake
def _(logits, keep, inv_temperature, top_p, min_p_offset):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)
