"""Attention of decode / verify queries over a paged KV cache.

Each request's T new positions (T = 1 for decode, K+1 for verify) are written into its pages, then query t
attends to keys 0..(context_len - T + t): causal inside the verify block. Every (request, query) is computed
on its own with a fixed key-block order, so a position's result is the same in a 1-token decode and in a
(K+1)-token verify, whatever the batch: the batch invariance MTP-on == MTP-off needs.

Two CUDA kernels compute that, `SPLIT_KV` picks the op's:
- unsplit: one program per (request row x query position, KV head) walks all visible keys in blocks of 32;
- split-KV (flash-decoding): the visible keys of each (row, position, KV head) are cut into chunks counted from
  position 0 (`SplitKvPlan.lead_split` keys each up to key `lead`, then `split` keys each), so a chunk's keys
  depend on the position alone, never on the batch, T or the launch. Programs compute chunk partials (running
  max, sum of exponentials, weighted values; same block loop as unsplit), then a second kernel merges each
  position's partials in a fixed order.
  A few programs per key head would leave most of a GPU idle at batch 1; chunks fill it. The T positions x
  GROUP query heads of a (request, KV head) share one tile of `SplitKvPlan.rows` pairs, so a verify reads each
  key block once for all its positions, not T times (at 128k context a K=3 verify read 4 x 8.6 GB of KV). A
  pair masks the keys past its own position; the tile's shape is the same constant for decode and verify, so a
  pair's products run the same MMAs wherever it sits (rows of a `tl.dot` never depend on each other), and the
  blocks past a pair's last key add exactly nothing to it (weight 0, rescale by exp(0) = 1).
Cache layout per layer: kv [2, pages, page_size, KV, D]; block_tables [B, max_pages] (int32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.attention import causal_attention
from qwen_mtp.ops.backend import cuda_kernel, reference_forced


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor
) -> None:
    """k, v [B, T, KV, D] go to `positions` [B, T] of each request's pages (tensor indexing: graph-safe)."""
    page_size = kv.shape[2]
    pages = torch.gather(block_tables, 1, (positions // page_size).to(block_tables.dtype)).long()
    offsets = positions % page_size
    kv[0, pages, offsets] = k.to(kv.dtype)
    kv[1, pages, offsets] = v.to(kv.dtype)


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _write_kv_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "sk_b", "sk_t", "sv_b", "sv_t"])
    def write_kv_pages(
        k_ptr, v_ptr, kv_ptr, tables_ptr, pos_ptr,
        T, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, s_half, s_page, s_slot, s_head, s_table,
        D: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one (request, new position, KV head): a plain copy into its page slot.
        triton_utils.wait_for_previous_kernel(PDL)
        pid = tl.program_id(0)
        b = pid // T
        t = pid % T
        h = tl.program_id(1)
        ds = tl.arange(0, D)
        pos = tl.load(pos_ptr + pid)
        offset = triton_utils.kv_slots(tables_ptr + b * s_table, pos, True, PAGE, s_page, s_slot)
        slot = kv_ptr + offset + h * s_head + ds
        k = tl.load(k_ptr + b * sk_b + t * sk_t + h * sk_h + ds)
        v = tl.load(v_ptr + b * sv_b + t * sv_t + h * sv_h + ds)
        tl.store(slot, k.to(kv_ptr.dtype.element_ty))
        tl.store(slot + s_half, v.to(kv_ptr.dtype.element_ty))

    return write_kv_pages


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor
) -> None:
    """Triton version of `write_kv`: one launch instead of the index arithmetic's several; k and v may be
    strided views (v is a slice of the fused q/k/v projection)."""
    batch, length, kv_heads, dim = k.shape
    k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (k, v))
    positions = positions.contiguous()
    assert kv.is_contiguous() and block_tables.is_contiguous()
    _write_kv_kernel()[(batch * length, kv_heads)](
        k, v, kv, block_tables, positions,
        length, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), block_tables.stride(0),
        D=dim, PAGE=kv.shape[2], **triton_utils.launch(k.device),
    )  # fmt: skip


def gather_kv(kv: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, length) of one request (page table row `table`): each [length, KV, D]."""
    positions = torch.arange(length, device=kv.device)
    pages, offsets = table[positions // kv.shape[2]].long(), positions % kv.shape[2]
    return kv[0, pages, offsets], kv[1, pages, offsets]


def paged_attention_reference(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, T, H, D] -> [B, T, H, D]; one query at a time through `scaled_dot_product_attention`."""
    batch, length = q.shape[:2]
    out = torch.empty_like(q)
    for b in range(batch):
        context = int(context_lens[b])
        keys, values = (t.transpose(0, 1)[None] for t in gather_kv(kv, block_tables[b], context))  # [1, KV, S, D]
        for t in range(length):
            end = context - length + t + 1
            query = q[b, t][None, :, None]  # [1, H, 1, D]
            out[b, t] = causal_attention(query, keys[:, :, :end], values[:, :, :end], scale)[0, :, 0]
    return out


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _paged_attention_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "sq_b"])  # one binary for decode (T=1) and verify (T=K+1)
    def paged_attention_rows(
        q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr,
        T, GROUP, scale,
        sq_b, sq_t, sq_h, s_half, s_page, s_slot, s_head, s_table,
        D: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one (request, query position, KV head) with its GROUP query heads; keys in blocks of
        # BLOCK_N positions in position order (each position looks up its own page, so any page size works).
        triton_utils.wait_for_previous_kernel(PDL)
        pid = tl.program_id(0)
        bi = pid // T
        t = pid % T
        kvh = tl.program_id(1)
        gs = tl.arange(0, BLOCK_G)
        ds = tl.arange(0, D)
        ns = tl.arange(0, BLOCK_N)
        gmask = gs < GROUP
        heads = kvh * GROUP + gs
        q = tl.load(q_ptr + bi * sq_b + t * sq_t + heads[:, None] * sq_h + ds[None, :], mask=gmask[:, None], other=0.0)
        visible = tl.load(lens_ptr + bi) - T + t + 1
        m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
        for first in range(0, visible, BLOCK_N):
            pos = first + ns
            smask = pos < visible
            k, v = triton_utils.load_kv_block(
                kv_ptr, tables_ptr + bi * s_table, pos, smask, kvh * s_head, ds, PAGE, s_half, s_page, s_slot
            )
            m, denom, acc = triton_utils.attend_block(
                q, k, v, smask[None, :], scale, m, denom, acc, INTERPRETED, PRECISION
            )
        out = acc / denom[:, None]
        tl.store(
            out_ptr + bi * sq_b + t * sq_t + heads[:, None] * sq_h + ds[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gmask[:, None],
        )

    return paged_attention_rows


def unsplit_attention_triton(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Triton version of `paged_attention_reference`: one program per (row x position, KV head)."""
    import triton

    batch, length, heads, dim = q.shape
    kv_heads, page_size = kv.shape[3], kv.shape[2]
    q = q.contiguous()
    assert kv.is_contiguous() and block_tables.is_contiguous()
    out = torch.empty_like(q)
    group = heads // kv_heads
    _paged_attention_kernel()[(batch * length, kv_heads)](
        q, kv, block_tables, context_lens, out,
        length, group, scale,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_tables.stride(0),
        D=dim, PAGE=page_size, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=32,
        INTERPRETED=triton_utils.INTERPRET, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **triton_utils.launch(q.device),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class SplitKvPlan:
    """How split-KV attention cuts the work. `split` and `block_n` fix which keys a partial sums and in what
    order, `merge` the order partials are merged in: a plan's numbers depend on them, so one plan serves every
    decode and verify step. `programs` only spreads chunks over programs and never changes a result."""

    split: int = 512  # keys per chunk after the lead, a multiple of block_n
    block_n: int = 32  # keys per block inside a chunk, in position order
    rows: int = 32  # (query position, query head) pairs per tile: a request's positions x its KV head's group
    warps: int = 4
    programs: int = 264  # chunk programs per launch, about 2 per SM of a 132-SM H200
    merge: int = 16  # partials the merge loads at once (its lanes; its warps follow from merge x head dim)
    # Load block i + 1's keys and values while block i is attended (the loop's next loads no longer wait for its
    # arithmetic); only when loads are issued changes, never a result.
    prefetch: bool = False
    # The first `lead` keys are cut into chunks of `lead_split` (then chunks of `split` from key `lead` on). Why:
    # a request's first keys in short chunks spread a short context over many programs (at batch 1 and 2048 keys,
    # 512-key chunks keep 16 programs busy, 64-key chunks 128), while a long context still merges few partials.
    # The boundaries stay a function of the position alone.
    lead: int = 0
    lead_split: int = 64

    def __post_init__(self):
        for name, size in (("split", self.split), ("lead_split", self.lead_split)):
            if size <= 0 or size % self.block_n:
                raise ValueError(f"SplitKvPlan: {name} ({size}) must be a multiple of block_n ({self.block_n})")
        if self.lead < 0 or self.lead % self.lead_split:
            raise ValueError(f"SplitKvPlan: lead ({self.lead}) must be a multiple of lead_split ({self.lead_split})")
        if self.rows < 16 or self.rows & (self.rows - 1):
            raise ValueError(f"SplitKvPlan: rows ({self.rows}) must be a power of two >= 16 (tl.dot's minimum)")

    def chunks(self, width: int, page_size: int) -> int:
        """The most chunks a row of a `width`-page table can have: the partials' shape, from shapes only."""
        keys = width * page_size
        return -(-min(keys, self.lead) // self.lead_split) + -(-max(keys - self.lead, 0) // self.split)


# The engine's plan: 512-key chunks from key 0. A lead of 64-key chunks up to key 2048 was measured (H100,
# benchmarks/decode_attention.py): at batch 1 it cuts a call from 38 to 14 us at 2048 keys and from 14 to 10 us
# at 128, but at batch 8 it costs 12-45% at 2048-8192 keys (more partials to store and merge where the keys
# already fill the GPU), and the cut may not depend on the batch. docs/benchmark-log.md has the runs.
SPLIT_KV_PLAN = SplitKvPlan()


@functools.cache  # build (and let Triton cache) the kernels once, on first use
def _split_kv_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T", "CHUNKS", "sq_b", "s_table"])  # one binary for every batch, T, table
    def partials(
        q_ptr, kv_ptr, tables_ptr, lens_ptr, m_ptr, denom_ptr, acc_ptr,
        T, GROUP, H, CHUNKS, scale,
        sq_b, sq_t, sq_h, s_half, s_page, s_slot, s_head, s_table,
        D: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr = False, LEAD: tl.constexpr = 0,
        LEAD_SPLIT: tl.constexpr = 64, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: chunks first, first + stride, ... of ROWS (query position, query head) pairs of one
        # (request, KV head): its T positions x GROUP heads, flattened, cut into tiles of ROWS. Chunk c holds the
        # keys `chunk_keys` gives it (LEAD_SPLIT-key chunks up to key LEAD, then SPLIT-key ones), in blocks of
        # BLOCK_N, each block loaded once for the tile; a pair sees the keys before its own position only. Which
        # program computes a chunk does not change its numbers.
        triton_utils.wait_for_previous_kernel(PDL)
        tiles = tl.cdiv(T * GROUP, ROWS)
        bi = tl.program_id(0) // tiles
        tile = tl.program_id(0) % tiles
        kvh = tl.program_id(1)
        pairs = tile * ROWS + tl.arange(0, ROWS)
        live = pairs < T * GROUP
        t = tl.where(live, pairs // GROUP, 0)
        heads = kvh * GROUP + pairs % GROUP
        ds = tl.arange(0, D)
        ns = tl.arange(0, BLOCK_N)
        q_rows = bi * sq_b + t * sq_t + heads * sq_h
        q = tl.load(q_ptr + q_rows[:, None] + ds[None, :], mask=live[:, None], other=0.0)
        context = tl.load(lens_ptr + bi)
        visible = context - T + t + 1  # [ROWS]: each pair sees keys [0, visible)
        reach = context - T + tl.minimum((tile * ROWS + ROWS - 1) // GROUP, T - 1) + 1  # the tile's furthest
        parts = ((bi * T + t).to(tl.int64) * H + heads) * CHUNKS  # [ROWS]: where each pair's partials start
        chunks = triton_utils.chunk_count(reach, SPLIT, LEAD, LEAD_SPLIT)
        for chunk in range(tl.program_id(2), chunks, tl.num_programs(2)):
            start, stop = triton_utils.chunk_keys(chunk, SPLIT, LEAD, LEAD_SPLIT)
            end = tl.minimum(stop, reach)
            ends = tl.minimum(stop, visible)  # [ROWS]: each pair's end in this chunk
            m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            denom = tl.zeros([ROWS], dtype=tl.float32)
            acc = tl.zeros([ROWS, D], dtype=tl.float32)
            table = tables_ptr + bi * s_table
            if PREFETCH:  # the same blocks in the same order, each loaded one iteration early
                pos = start + ns
                k, v = triton_utils.load_kv_block(
                    kv_ptr, table, pos, pos < end, kvh * s_head, ds, PAGE, s_half, s_page, s_slot
                )
                for first in range(start, end, BLOCK_N):
                    after = first + BLOCK_N + ns
                    k_next, v_next = triton_utils.load_kv_block(
                        kv_ptr, table, after, after < end, kvh * s_head, ds, PAGE, s_half, s_page, s_slot
                    )
                    pos = first + ns
                    m, denom, acc = triton_utils.attend_block(
                        q, k, v, pos[None, :] < ends[:, None], scale, m, denom, acc, INTERPRETED, PRECISION
                    )
                    k, v = k_next, v_next
            else:
                for first in range(start, end, BLOCK_N):
                    pos = first + ns
                    k, v = triton_utils.load_kv_block(
                        kv_ptr, table, pos, pos < end, kvh * s_head, ds, PAGE, s_half, s_page, s_slot
                    )
                    m, denom, acc = triton_utils.attend_block(
                        q, k, v, pos[None, :] < ends[:, None], scale, m, denom, acc, INTERPRETED, PRECISION
                    )
            # Stored only where the chunk is one of the pair's: the merge reads no other, and a pair whose keys end
            # before `start` saw none here (its running max stayed -inf, its partials are NaN).
            mine = live & (start < visible)
            tl.store(m_ptr + parts + chunk, m, mask=mine)
            tl.store(denom_ptr + parts + chunk, denom, mask=mine)
            tl.store(acc_ptr + (parts + chunk)[:, None] * D + ds[None, :], acc, mask=mine[:, None])

    @triton.jit(do_not_specialize=["T", "CHUNKS", "sq_b"])
    def merge(
        m_ptr, denom_ptr, acc_ptr, lens_ptr, out_ptr,
        T, H, CHUNKS, sq_b, sq_t, sq_h,
        D: tl.constexpr, SPLIT: tl.constexpr, MERGE: tl.constexpr, LEAD: tl.constexpr = 0,
        LEAD_SPLIT: tl.constexpr = 64, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # One program: one (row, query position, query head). Partials are rescaled to the position's maximum
        # score (a max: exact in any order); lane j sums chunks j, j + MERGE, j + 2 MERGE, ... in chunk order,
        # then the lanes are summed: the order depends on the number of chunks, hence on the position, alone.
        triton_utils.wait_for_previous_kernel(PDL)
        pid = tl.program_id(0)
        h = tl.program_id(1)
        bi = pid // T
        t = pid % T
        cs = tl.arange(0, MERGE)
        ds = tl.arange(0, D)
        chunks = triton_utils.chunk_count(tl.load(lens_ptr + bi) - T + t + 1, SPLIT, LEAD, LEAD_SPLIT)
        parts = (pid.to(tl.int64) * H + h) * CHUNKS
        top = tl.full([MERGE], float("-inf"), dtype=tl.float32)
        for first in range(0, chunks, MERGE):
            top = tl.maximum(top, tl.load(m_ptr + parts + first + cs, mask=first + cs < chunks, other=float("-inf")))
        top_all = tl.max(top, axis=0)
        denom = tl.zeros([MERGE], dtype=tl.float32)
        acc = tl.zeros([MERGE, D], dtype=tl.float32)
        for first in range(0, chunks, MERGE):
            live = first + cs < chunks
            weight = tl.exp(tl.load(m_ptr + parts + first + cs, mask=live, other=float("-inf")) - top_all)
            denom += tl.load(denom_ptr + parts + first + cs, mask=live, other=0.0) * weight
            part = tl.load(acc_ptr + (parts + first + cs)[:, None] * D + ds[None, :], mask=live[:, None], other=0.0)
            acc += part * weight[:, None]
        out = tl.sum(acc, axis=0) / tl.sum(denom, axis=0)
        tl.store(out_ptr + bi * sq_b + t * sq_t + h * sq_h + ds, out.to(out_ptr.dtype.element_ty))

    return partials, merge


def split_kv_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: SplitKvPlan = SPLIT_KV_PLAN,
) -> torch.Tensor:
    """Triton version of `paged_attention_reference`, split-KV (see the module docstring). Graph-capturable: the
    grid and the partials' buffers come from shapes only (the table's width bounds the chunks; programs past a
    row's last chunk do nothing), never from the context lengths' values."""
    import triton

    batch, length, heads, dim = q.shape
    kv_heads, page_size = kv.shape[3], kv.shape[2]
    q = q.contiguous()
    assert kv.is_contiguous() and block_tables.is_contiguous()
    out = torch.empty_like(q)
    group, rows, chunks = heads // kv_heads, batch * length, plan.chunks(block_tables.shape[1], page_size)
    m = torch.empty(rows, heads, chunks, dtype=torch.float32, device=q.device)  # [row, head, chunk]
    denom = torch.empty_like(m)
    acc = torch.empty(rows, heads, chunks, dim, dtype=torch.float32, device=q.device)
    tiles = batch * triton.cdiv(length * group, plan.rows)  # pair tiles: the programs' first grid axis
    programs = max(1, min(chunks, -(-plan.programs // (tiles * kv_heads))))  # per (tile, KV head)
    partials, merge = _split_kv_kernels()
    partials[(tiles, kv_heads, programs)](
        q, kv, block_tables, context_lens, m, denom, acc,
        length, group, heads, chunks, scale,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_tables.stride(0),
        D=dim, PAGE=page_size, ROWS=plan.rows, BLOCK_N=plan.block_n,
        SPLIT=plan.split, INTERPRETED=triton_utils.INTERPRET,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PREFETCH=plan.prefetch, LEAD=plan.lead,
        LEAD_SPLIT=plan.lead_split, num_warps=plan.warps,
        **triton_utils.launch(q.device),
    )  # fmt: skip
    merge[(rows, heads)](
        m, denom, acc, context_lens, out, length, heads, chunks, q.stride(0), q.stride(1), q.stride(2),
        D=dim, SPLIT=plan.split, MERGE=plan.merge, LEAD=plan.lead, LEAD_SPLIT=plan.lead_split,
        num_warps=min(16, max(4, plan.merge * dim // 1024)),
        **triton_utils.launch(m.device),
    )  # fmt: skip
    return out


# The op's CUDA kernel: split-KV (H200, 27B synthetic, B1: plain decode 21.97 -> 15.77 ms/token at 8k context,
# 15.93 ms at 32k against 40.4 unsplit; benchmarks/decode_attention.py has the per-call table, docs/benchmark-log.md
# the runs). False runs the unsplit kernel. Read at each call (a CUDA graph keeps the kernel it captured).
SPLIT_KV = True


def paged_attention_triton(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Triton version of `paged_attention_reference`: split-KV if `SPLIT_KV`, else unsplit."""
    attend = split_kv_attention_triton if SPLIT_KV else unsplit_attention_triton
    return attend(q, kv, block_tables, context_lens, scale)


def register_paged_attention(
    name: str,
    attend_reference: Callable[..., torch.Tensor],
    attend_triton: Callable[..., torch.Tensor],
    supported: Callable[[torch.Tensor], bool] = lambda q: True,
):
    """Register the custom op `qwen_mtp::<name>`: write the step's k, v [B, T, KV, D] at `positions`, then
    attend with `attend_*(q, kv, block_tables, context_lens, scale)` -> [B, T, H, D], contiguous. The reference
    runs on CPU (and on CUDA where `supported(q)` is false or `reference_forced(name)`), the Triton kernel on
    CUDA. Decode/verify attention (here) and prefill attention (`prefill_attention.py`) share this contract and
    differ only in the kernel."""

    def on_reference(q, k, v, kv, block_tables, context_lens, positions, scale):
        write_kv(k, v, kv, block_tables, positions)
        return attend_reference(q, kv, block_tables, context_lens, scale).contiguous()

    @torch.library.custom_op(f"qwen_mtp::{name}", mutates_args=("kv",))
    def op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return on_reference(q, k, v, kv, block_tables, context_lens, positions, scale)

    @cuda_kernel(op)
    def _(q, k, v, kv, block_tables, context_lens, positions, scale):
        if reference_forced(name) or not supported(q):
            return on_reference(q, k, v, kv, block_tables, context_lens, positions, scale)
        write_kv_triton(k, v, kv, block_tables, positions)
        return attend_triton(q, kv, block_tables, context_lens, scale)

    @op.register_fake
    def _(q, k, v, kv, block_tables, context_lens, positions, scale):
        return q.new_empty(q.shape)  # contiguous, as both implementations return

    return op


# One query at a time over exactly its visible keys: position p of a (K+1)-token verify is computed as a
# 1-token decode at p computes it.
paged_attention = register_paged_attention("paged_attention", paged_attention_reference, paged_attention_triton)
