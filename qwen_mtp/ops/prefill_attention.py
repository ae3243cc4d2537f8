"""Attention of a prompt chunk over a paged KV cache (prefill), as the custom op
`qwen_mtp::paged_prefill_attention`.

A chunk feeds T positions per request, the last T of its context (`context_lens` after the chunk): the op writes
their k, v into the request's pages, then query t attends to keys 0..context_len - T + t.

- CPU: gather the request's pages and run `causal_attention` (SDPA, as Hugging Face calls it): bit for bit HF's.
- CUDA: a Triton flash-attention kernel that reads keys and values straight from the pages. Why our own: the
  gather copies the whole context per layer and needs the context length on the host (a sync, and a graph
  break that kept prefill from compiling as one graph); and SDPA picks its kernel (cuDNN, flash, efficient) by
  shape, so a prompt's rounding could depend on the chunk length it happened to land in. Here tiles and the
  key-block order are fixed: a query's numbers depend on its position and context only.

Tiling: the chunk's (query position, query head) pairs of one KV head are flattened (GQA: the heads sharing a
KV head share its key loads) and cut into tiles of ROWS pairs; a program walks its tile's visible keys in
blocks of BLOCK_N positions (online softmax, in base 2: `triton_helpers.attend_block_log2`), skipping blocks that
no query of the tile can see. At long context nearly every block is visible to every pair of the tile: those run
without the causal select, and only the blocks on the tile's diagonal are masked: beside the two products, the
per-score work (select, exponent, running sums) is what a block's time is made of. Programs start with the last
tiles of the chunk, which see the most keys, so the short first tiles fill the last wave.
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.attention import causal_attention
from qwen_mtp.ops.paged_attention import gather_kv, register_paged_attention

# (query pairs per program, keys per block, warps, pipeline stages): fixed, see the module docstring. Chosen on the
# H200 at Qwen3.5-27B shapes (head dim 256, 24 query / 4 KV heads) with benchmarks/prefill.py.
ROWS, BLOCK_N, WARPS, STAGES = 128, 64, 8, 2
LOG2E = 1.4426950408889634  # the kernel's exponentials are base 2: scores are scaled by scale * log2(e)


def supported(q: torch.Tensor) -> bool:
    """Head sizes the kernel tiles (`tl.dot` needs >= 16, `tl.arange` a power of two); others take the
    reference path, on CUDA too."""
    dim = q.shape[-1]
    return dim >= 16 and dim & (dim - 1) == 0


def prefill_attention_reference(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, T, H, D] -> [B, T, H, D]: each request's chunk over its pages, causal, through `causal_attention`."""
    out = q.new_empty(q.shape)  # contiguous whatever q's strides
    for b in range(q.shape[0]):
        keys, values = gather_kv(kv, block_tables[b], int(context_lens[b]))  # [S, KV, D]
        query = q[b].transpose(0, 1)[None]  # [1, H, T, D]
        attended = causal_attention(query, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], scale)
        out[b] = attended[0].transpose(0, 1)
    return out


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _prefill_attention_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "sq_b", "sq_t"])
    def prefill_attention(
        q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr,
        T, GROUP, qk_scale,
        sq_b, sq_t, sq_h, so_b, so_t, so_h, s_half, s_page, s_slot, s_head, s_table,
        D: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: ROWS consecutive (query position, head-in-group) pairs of one (request, KV head); the
        # last tile first.
        triton_utils.wait_for_previous_kernel(PDL)
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
        bi = tl.program_id(2)
        pairs = tile * ROWS + tl.arange(0, ROWS)
        valid = pairs < T * GROUP
        t = tl.where(valid, pairs // GROUP, 0)
        heads = kvh * GROUP + pairs % GROUP
        ds = tl.arange(0, D)
        ns = tl.arange(0, BLOCK_N)
        q_rows = bi * sq_b + t * sq_t + heads * sq_h
        q = tl.load(q_ptr + q_rows[:, None] + ds[None, :], mask=valid[:, None], other=0.0)
        table = tables_ptr + bi * s_table
        context = tl.load(lens_ptr + bi)
        visible = context - T + t + 1  # keys [0, visible) for each pair
        last_t = tl.minimum((tile * ROWS + ROWS - 1) // GROUP, T - 1)
        end = context - T + last_t + 1  # no pair of this tile sees a key at or past `end`
        seen_by_all = context - T + (tile * ROWS) // GROUP + 1  # every pair sees keys [0, seen_by_all)
        unmasked_end = (seen_by_all // BLOCK_N) * BLOCK_N
        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        for first in range(0, unmasked_end, BLOCK_N):
            pos = first + ns
            k, v = triton_utils.load_kv_block(
                kv_ptr, table, pos, pos < unmasked_end, kvh * s_head, ds, PAGE, s_half, s_page, s_slot
            )
            m, denom, acc = triton_utils.attend_block_log2(
                q, k, v, None, False, qk_scale, m, denom, acc, INTERPRETED, PRECISION
            )
        for first in range(unmasked_end, end, BLOCK_N):
            pos = first + ns
            k, v = triton_utils.load_kv_block(
                kv_ptr, table, pos, pos < end, kvh * s_head, ds, PAGE, s_half, s_page, s_slot
            )
            sees = pos[None, :] < visible[:, None]
            m, denom, acc = triton_utils.attend_block_log2(
                q, k, v, sees, True, qk_scale, m, denom, acc, INTERPRETED, PRECISION
            )
        out_rows = bi * so_b + t * so_t + heads * so_h
        tl.store(
            out_ptr + out_rows[:, None] + ds[None, :],
            (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
            mask=valid[:, None],
        )

    return prefill_attention, triton.cdiv


def prefill_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    rows: int = ROWS,
    block_n: int = BLOCK_N,
    warps: int = WARPS,
    stages: int = STAGES,
) -> torch.Tensor:
    """Triton version of `prefill_attention_reference`; q may be a strided view ([B, T, H, D], unit stride
    in D). `rows`, `block_n`, `warps`, `stages` exist for the benchmark's tile sweep; the engine uses the
    defaults."""
    batch, length, heads, dim = q.shape
    kv_heads, page_size = kv.shape[3], kv.shape[2]
    if q.stride(3) != 1:
        q = q.contiguous()
    assert kv.is_contiguous() and block_tables.is_contiguous()
    out = torch.empty(batch, length, heads, dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    kernel, cdiv = _prefill_attention_kernel()
    kernel[(cdiv(length * group, rows), kv_heads, batch)](
        q, kv, block_tables, context_lens, out,
        length, group, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), block_tables.stride(0),
        D=dim, PAGE=page_size, ROWS=rows, BLOCK_N=block_n,
        INTERPRETED=triton_utils.INTERPRET, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages, **triton_utils.launch(q.device),
    )  # fmt: skip
    return out


paged_prefill_attention = register_paged_attention(
    "paged_prefill_attention", prefill_attention_reference, prefill_attention_triton, supported
)
