"""The sampler's device ops: a Gumbel-max choice per row with counter-based noise (`sample_tokens`), and the
top-p cut over a sorted row (`top_p_threshold`); plain-torch references beside their Triton kernels.

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
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import reference_forced

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


def top_p_threshold_reference(
    ordered: torch.Tensor,  # [R, V] float32 logits, sorted descending per row
    keep: torch.Tensor,  # [R] long in [1, V]: the tokens top-k keeps
    inv_temperature: torch.Tensor,  # [R] float32
    top_p: torch.Tensor,  # [R] float32 in (0, 1]
    block: int = BLOCK,
) -> torch.Tensor:
    """The logit of the last token top-p keeps [R]: the smallest prefix of the top-k tokens whose probability
    mass (softmax at the temperature, renormalised over the top-k) reaches top_p. Unnormalised masses
    e_i = exp((l_i - l_0) * inv_temperature); a token is kept while the mass before it is < top_p * sum(e)."""
    rows, vocab = ordered.shape
    index = torch.arange(vocab, device=ordered.device)
    inside = index[None, :] < keep[:, None]
    mass = torch.where(inside, torch.exp((ordered - ordered[:, :1]) * inv_temperature[:, None]), 0.0)
    chunks = -(-vocab // block)
    padded = torch.zeros(rows, chunks * block, device=ordered.device)
    padded[:, :vocab] = mass
    total = padded.view(rows, chunks, block).sum(dim=1).sum(dim=-1)  # lanes over the chunks, then across: as the kernel
    before = torch.cumsum(mass, dim=-1) - mass
    count = (inside & (before < (top_p * total)[:, None])).sum(dim=-1).clamp(min=1)
    return ordered.gather(1, (count - 1)[:, None])[:, 0]


# ---- Triton -----------------------------------------------------------------------------------------------------
@functools.cache  # build (and let Triton cache) the kernels once, on first use
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partials(
        logits_ptr, stride, vocab, inv_t_ptr, threshold_ptr, seed_ptr, position_ptr,
        best_ptr, index_ptr, max_ptr, sum_ptr, chunks,
        FILTERED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
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
    def combine(best_ptr, index_ptr, max_ptr, sum_ptr, tokens_ptr, lse_ptr, chunks, BLOCK_C: tl.constexpr):
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

    @triton.jit
    def top_p_cut(ordered_ptr, stride, keep_ptr, inv_t_ptr, top_p_ptr, out_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        keep = tl.load(keep_ptr + row)
        inv_t = tl.load(inv_t_ptr + row)
        head = tl.load(ordered_ptr + row * stride)
        lanes = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, keep, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < keep
            x = tl.load(ordered_ptr + row * stride + offs, mask=inside, other=float("-inf"))
            lanes += tl.where(inside, tl.exp((x - head) * inv_t), 0.0)
        target = tl.load(top_p_ptr + row) * tl.sum(lanes, axis=0)
        count = tl.zeros([], dtype=tl.int64)
        before = tl.zeros([], dtype=tl.float32)
        start = 0
        while (start < keep) & (before < target):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < keep
            x = tl.load(ordered_ptr + row * stride + offs, mask=inside, other=float("-inf"))
            mass = tl.where(inside, tl.exp((x - head) * inv_t), 0.0)
            running = before + tl.cumsum(mass, axis=0) - mass
            count += tl.sum(tl.where(inside & (running < target), 1, 0), axis=0).to(tl.int64)
            before += tl.sum(mass, axis=0)
            start += BLOCK
        count = tl.maximum(count, 1)
        tl.store(out_ptr + row, tl.load(ordered_ptr + row * stride + count - 1))

    return partials, combine, top_p_cut


def sample_tokens_triton(logits, inv_temperature, threshold, seed, position, block: int = BLOCK):
    """Triton version of `sample_tokens_reference` (same arguments and results)."""
    import triton

    partials, combine, _ = _kernels()
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
        enable_fp_fusion=False,  # no mul+add -> FMA contraction: the reference rounds the product first
    )  # fmt: skip
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    combine[(rows,)](best, index, top, total, tokens, lse, chunks, BLOCK_C=max(2, triton.next_power_of_2(chunks)))
    return tokens, lse


def top_p_threshold_triton(ordered, keep, inv_temperature, top_p, block: int = BLOCK):
    """Triton version of `top_p_threshold_reference`: one program per row, masses summed in fixed lanes."""
    _, _, top_p_cut = _kernels()
    assert ordered.stride(1) == 1
    keep, inv_temperature, top_p = (t.contiguous() for t in (keep, inv_temperature, top_p))  # one per row (above)
    out = torch.empty(ordered.shape[0], dtype=torch.float32, device=ordered.device)
    top_p_cut[(ordered.shape[0],)](ordered, ordered.stride(0), keep, inv_temperature, top_p, out, BLOCK=block)
    return out


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


@sample_tokens.register_kernel("cuda")
def _(logits, inv_temperature, threshold, seed, position):
    if reference_forced("sample_tokens"):
        return sample_tokens_reference(logits, inv_temperature, threshold, seed, position)
    return sample_tokens_triton(logits, inv_temperature, threshold, seed, position)


@sample_tokens.register_fake
def _(logits, inv_temperature, threshold, seed, position):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("qwen_mtp::top_p_threshold", mutates_args=())
def top_p_threshold(
    ordered: torch.Tensor, keep: torch.Tensor, inv_temperature: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Custom op: `top_p_threshold_reference` on CPU, one Triton launch on CUDA."""
    return top_p_threshold_reference(ordered, keep, inv_temperature, top_p)


@top_p_threshold.register_kernel("cuda")
def _(ordered, keep, inv_temperature, top_p):
    if reference_forced("top_p_threshold"):
        return top_p_threshold_reference(ordered, keep, inv_temperature, top_p)
    return top_p_threshold_triton(ordered, keep, inv_temperature, top_p)


@top_p_threshold.register_fake
def _(ordered, keep, inv_temperature, top_p):
    return ordered.new_empty(ordered.shape[0], dtype=torch.float32)
