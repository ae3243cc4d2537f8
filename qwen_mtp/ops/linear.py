"""The linear op `qwen_mtp::linear(x, weight, invariant)`: every projection of the model goes through it.

`invariant=False` is the device's fastest GEMM (`F.linear`: cuBLAS on CUDA, and on CPU exactly what Hugging
Face computes). `invariant=True` is what the decode, verify and draft steps ask for: a row's result must not
depend on the other rows. A GEMM library picks its kernel by the number of rows: on CPU, fp32 `F.linear` over
1 row and over 8 rows round differently (measured: ~1000 of 1000-odd row comparisons differ in the last bit);
cuBLAS likewise picks kernels (and split-K) by M. Greedy decoding must give a request the same tokens whatever
else shares its batch, so on that path every row's reduction order must not depend on the row count:
- CPU (and CUDA with `ops.backend.reference_ops()`): every row is its own 1-row product (`rowwise_products`);
- CUDA: our Triton GEMM. Its split of the K loop is a function of (N, K) only (a `GemmPlan`), the split partial
  sums are added in one fixed order (never accumulated with atomics), and M is never specialised, so a row's
  result is the same for M = 1 and M = 160 (its tiles may also depend on M's row bucket, which changes no bit:
  "Row buckets" below). Splitting K keeps the GPU busy on shapes with few
  output tiles (tall K like `down_proj`, tiny N like `in_proj_a`), where one program per tile would leave most
  SMs idle. Two kernel families, picked by the plan: "grid" (the default today: a program per 16-row tile, so
  the weight is read again for every 16 rows) and "stream" (a program per weight slice that runs up to
  `row_tiles x block_m` rows through each weight block it loads; see `_stream_kernel`).

Row buckets. A plan's row tile suits some row counts: 32-row MMAs serve one request's decode at the copy
bandwidth, but a 128-row verify then runs four of them per weight block (1.3-1.6x cuBLAS). On Hopper an element's
bits depend only on the K split points (and mma.sync against wgmma), not on the tile shapes (`sum_order`,
measured), so a shape may list plans for larger launches (`ROW_BUCKETS`, `row_plan`): every launch picks its
plan from M, and every plan of a shape sums as its `gemm_plan` does, so a row's result is still the same at any M.

Tile loads. A "grid" or "stream" plan may load its tiles by the Hopper tensor memory accelerator
(`GemmPlan.tma_loads`; the W8A8 kernel too): the same blocks, zeros past M, N and K, and K splits end on BLOCK_K
boundaries, so a plan sums as it does with pointer loads, and a launch may pick either. Measured on the H200
(`benchmarks/gemm_tma_loads.py`) they win at wide launches and lose at one row (the W8A8 in_proj: 1.14x at M = 1,
0.94x at M = 128), so `TMA_LOAD_BUCKETS` names the row buckets that load by TMA, per kernel and shape.
`QWEN_MTP_TMA_LOADS=1` (every decode plan) or `=0` (none) overrides it for an engine-wide A/B.

L2 prefetch. Under a CUDA graph every kernel of ours launches with programmatic dependent launch, so a GEMM's
programs start while the kernel before it (often a short norm or quantization that leaves HBM idle) still runs,
and wait. A plan's `l2_prefetch` has each program first ask L2 for its weight slice's first K blocks
(`triton_utils.prefetch_weight_rows`, `l2_prefetch_columns`); weights are never written during a step, so this
races with nothing and changes no bit. The kernels take the weight's address for it beside the tile loads' source,
so a plan loading by TMA (whose weight operand is a descriptor) prefetches too. Every decode plan asks for
`L2_PREFETCH` K blocks (`row_plan`; default 2, `QWEN_MTP_L2_PREFETCH=N` for the engine-wide A/B of `gpu_suite.sh`
STAGE=prefetch, 0: none). Measured on an H100 (thirty-fifth session, 27B, plain and K=3 at B1 / B8 / B32, each
against 0 in the same call): 2 blocks made FP8 steps 1.5-2.4% faster (B1 plain 11.89 -> 11.64 ms) and bf16 steps
0.1-0.5%; 4 blocks did as 2, 8 nothing, 16 made FP8 B1 8% slower. The sixteenth session's loss (H200, 4 blocks,
FP8 B1 9.06 -> 9.41 ms) came with the TMA loads turned off, which the prefetch then required.

It is a custom op so `torch.compile` keeps it opaque and CUDA graphs capture it; backward is the plain GEMM
gradient, so training runs the same module code.

Prefill rows. A packed prefill (mixed steps) also asks for `invariant=True`: a request's numbers must not depend
on the chunks packed beside it, and its forward has hundreds to thousands of rows. The decode plans are built for
M = 1..64 (16-32-row MMAs, few programs walking every row: 2.8x cuBLAS at M = 4096 on the 27B's shapes), so
inside `prefill_rows()` the invariant GEMM takes the prefill plan table instead (`prefill_gemm_plan`: the "tma"
family, 128 x 256 tiles loaded by the tensor memory accelerator, no K split, as a dense GEMM library tiles a large
M; 0.93-0.99x cuBLAS for one 27B forward's linears at M = 2048..8192). It is still a function of (N, K) only, so a
prefill row's result does not depend on how many rows share the launch; it does differ from the same row on the
decode path, which no property needs (decode and verify rows never take these plans).

`qwen_mtp::linear_fp8(x, weight, scale, invariant, w8a8)` is the same product with an FP8 e4m3 weight [N, K] and its
128x128 block scales [ceil(N/128), ceil(K/128)] (W8A16: activations stay in their dtype). Its reference, on CPU
and wherever the reference is forced, dequantizes as transformers does, `(fp8.float() * scale).to(x.dtype)`,
then runs the product above. On CUDA the invariant path is the same two kernel families with the weight tile
dequantized in registers by that formula (so with the same plan it equals the bf16 kernel on the dequantized
weight bit for bit; in bf16 without conversion instructions, exact for bf16-valued scales as Qwen stores
them: `triton_helpers.fp8_dequantize`), with its own plans (`TUNED_FP8`, a function of (N, K) only); the other
path (prefill) is `FP8_PREFILL`'s choice (see `_fp8_prefill`). `w8a8=True` (the linear modules' `fp8_decode =
"w8a8"`, the default) instead runs the CUDA decode path with e4m3 activations (per row and 1x128 group) into an
fp8 x fp8 "stream" GEMM whose 128-deep block products are scaled in fp32 (`w8a8_matmul_triton`, its reference
`linear_fp8_w8a8_reference`): batch-invariant too, faster on the H200, but no longer transformers' W8A16 numbers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.triton_utils import INTERPRET
from qwen_mtp.quant.fp8 import FP8_BLOCK, FP8_MAX, SCALE_FLOOR, dequantize_fp8_block

# QWEN_MTP_TMA_LOADS=1: every decode plan (`row_plan`) loads its tiles by the tensor memory accelerator where it
# runs (`GemmPlan.tma_loads`; the same bits); =0: none does; unset: the row buckets `TMA_LOAD_BUCKETS` names. The
# engine-wide A/B of `benchmarks/gpu_suite.sh` STAGE=tmaloads.
TMA_LOADS: bool | None = {"1": True, "0": False}.get(os.environ.get("QWEN_MTP_TMA_LOADS", ""))
# Every decode plan (`row_plan`) prefetches the first L2_PREFETCH K blocks of each program's weight slice into L2
# before it waits on the previous kernel (`GemmPlan.l2_prefetch`; its tile loads stay as the tables say; why 2: the
# module docstring). QWEN_MTP_L2_PREFETCH=N sets N (0: none), the engine-wide A/B of `benchmarks/gpu_suite.sh`
# STAGE=prefetch.
L2_PREFETCH = int(os.environ.get("QWEN_MTP_L2_PREFETCH", "2"))
TARGET_PROGRAMS = 320  # programs in flight for an untuned shape: ~2-3 per SM on a 132-SM H200
FAMILIES = ("grid", "stream", "tma")
MAX_ROW_TILES = 8  # a stream plan compiles one K loop per live row-tile count 1..row_tiles: code grows as its square


@dataclass(frozen=True)
class GemmPlan:
    """How one [N, K] weight is tiled: a function of the weight's shape only, never of M (batch invariance).

    `family` picks the kernel. "grid": a program per (row tile, N tile, K split); every `block_m` rows read the
    weight again (from L2 at best, since a weight tile's row tiles are neighbours in launch order). "stream": a
    program per (N tile, K split) runs all the rows through its weight slice, `row_tiles` tiles of `block_m`
    rows sharing every weight block it loads (see `_stream_kernel`). "tma": prefill row counts only, one K split,
    tiles loaded by the Hopper tensor memory accelerator (see `_tma_kernel`). `block_m` is the row count of every
    `tl.dot`, which fixes the MMA instruction (on Hopper: mma.sync below 64 rows, wgmma from 64).
    """

    block_n: int
    block_k: int
    k_per_split: int  # K blocks per split: the K loop is cut into ceil(K blocks / k_per_split) splits
    num_warps: int = 4
    num_stages: int = 3
    family: str = "grid"
    block_m: int = 16  # rows per tl.dot (16 is tl.dot's minimum)
    row_tiles: int = 1  # "stream": row tiles sharing each weight block (rows per weight pass: row_tiles x block_m)
    swap_ab: bool = False  # "stream": the weight block is the MMA's row side (A) and the rows its column side
    wide_stages: int = 0  # "stream": pipeline depth of the K loops of 2+ live row tiles (0: num_stages)
    tail_tiles: int = 0  # "stream", one K split: the last tail_tiles N tiles split K tail_splits ways (a short
    tail_splits: int = 1  # last wave: its tiles spread over more SMs; `stream_tail`)
    group_m: int = 8  # "tma": row tiles that walk the N tiles together (each weight tile read once per group)
    persistent: bool = False  # "tma": a program per SM looping over the tiles, instead of a program per tile
    tma_loads: bool = False  # "grid", "stream": tiles copied by the tensor memory accelerator where it runs
    l2_prefetch: int = 0  # "grid", "stream": K blocks asked of L2 before the PDL wait (`row_plan`)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"GemmPlan.family must be one of {FAMILIES}, got {self.family!r}")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"GemmPlan.block_m must be a power of two >= 16, got {self.block_m}")
        if not 1 <= self.row_tiles <= (MAX_ROW_TILES if self.family == "stream" else 1):
            raise ValueError(f"GemmPlan.row_tiles must be 1 for 'grid', 1..{MAX_ROW_TILES} for 'stream'")
        if self.swap_ab and self.family != "stream":
            raise ValueError("GemmPlan.swap_ab is a 'stream' option")
        if self.wide_stages and (self.family != "stream" or self.wide_stages < 1):
            raise ValueError("GemmPlan.wide_stages is a 'stream' option: a pipeline depth >= 1, or 0 for num_stages")
        if (self.tail_tiles or self.tail_splits != 1) and (
            self.family != "stream" or self.tail_tiles < 1 or self.tail_splits < 2
        ):
            raise ValueError("GemmPlan.tail_tiles / tail_splits are a 'stream' option: >= 1 tiles in >= 2 splits")
        if self.group_m < 1 or (self.persistent and self.family != "tma"):
            raise ValueError("GemmPlan.group_m must be >= 1, and GemmPlan.persistent is a 'tma' option")
        if self.tma_loads and self.family == "tma":
            raise ValueError("GemmPlan.tma_loads is a 'grid' / 'stream' option (the 'tma' family always loads so)")
        if self.l2_prefetch < 0 or (self.l2_prefetch and self.family == "tma"):
            raise ValueError("GemmPlan.l2_prefetch is K blocks (>= 0) of a 'grid' / 'stream' plan")

    def splits(self, k: int) -> int:
        k_blocks = -(-k // self.block_k)
        return -(-k_blocks // self.k_per_split)


def rowwise_products(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [P, 1, K] @ weights [P, K, N] -> [P, 1, N], every product computed exactly as it would be alone.

    fp32 / fp64: one `bmm` (MKL's per-matrix GEMM, measured invariant in P). Other dtypes: one product per row.
    A bf16 `bmm` goes to oneDNN only once P * K * N passes 16^3, so at small shapes (64 x 64, the fixtures'
    projections) one row alone took another kernel than the same row among P >= 2 and rounded it differently
    (2 rows in 2048); oneDNN's batched call also copies a broadcast weight per row (~40x slower than a product
    per row at 1024 x 1024, P = 8). A product per row has the same shape whatever P: the same kernel."""
    if rows.dtype in (torch.float32, torch.float64):
        return torch.bmm(rows, weights)
    return torch.stack([row @ weight for row, weight in zip(rows, weights, strict=True)])


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear` with each row of x reduced on its own: the result of a row never depends on the others."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, 1, in_features)
    out = rowwise_products(rows, weight.t().unsqueeze(0).expand(rows.shape[0], in_features, out_features))
    return out.reshape(*x.shape[:-1], out_features)


# Measured on the H200 (benchmarks/gemm_sweep.py, 2026-11-29): the fastest batch-invariant plan per
# Qwen3.5-27B decode shape at M = 1 and 8 (e.g. in_proj_a/b 6.5 us vs 34.9 us for the default plan).
TUNED: dict[tuple[int, int], GemmPlan] = {
    # qwen3.5-27b gdn in_proj (fused): f swap32x4 s1
    (16480, 5120): GemmPlan(128, 128, 40, 8, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-27b gdn out_proj / attn o_proj: f swap32x4 s3
    (5120, 6144): GemmPlan(128, 128, 16, 8, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-27b attn qkv (fused): f swap32x4 s1
    (14336, 5120): GemmPlan(128, 128, 40, 8, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-27b mlp gate_up (fused): e swap32x4 deep8 tail8 (H200, 2026-12-01, sixth session: 85.5 us at M=1
    # against cuBLAS 84.2, 141.6 at M=128; docs/img/gemm-family-27b-gate_up-wp6gemm.json)
    (34816, 5120): GemmPlan(64, 128, 40, 4, 8, "stream", 32, 4, True, wide_stages=4, tail_tiles=16, tail_splits=8),
    # qwen3.5-27b mlp down: f swap32x4 s3
    (5120, 17408): GemmPlan(128, 128, 46, 8, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-27b mtp fc: f swap32x4 s3
    (5120, 10240): GemmPlan(128, 128, 27, 8, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-27b lm_head: f swap32x4 deep4 s1 (H200, 2026-12-01, sixth session: 568.7 us at M=1 against 631.4
    # for c 64x2 s1 and 616.1 for cuBLAS, 884 against 756 at M=128; docs/img/gemm-family-27b-lm_head-wp6gemm.json)
    (248320, 5120): GemmPlan(128, 128, 40, 8, 4, "stream", 32, 4, True, wide_stages=3),
    # qwen3.5-9b gdn in_proj (fused): grid64 s2
    (12352, 4096): GemmPlan(128, 64, 32, 4, 4, block_m=64),
    # qwen3.5-9b gdn out_proj / attn o_proj: e swap32x4 s2
    (4096, 4096): GemmPlan(64, 128, 16, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-9b attn qkv (fused): grid64 s3
    (10240, 4096): GemmPlan(128, 64, 22, 4, 4, block_m=64),
    # qwen3.5-9b mlp gate_up (fused): e swap32x4 s1
    (24576, 4096): GemmPlan(64, 128, 32, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-9b mlp down: e swap32x4 s2
    (4096, 12288): GemmPlan(64, 128, 48, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-9b mtp fc: e swap32x4 s2
    (4096, 8192): GemmPlan(64, 128, 32, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-9b lm_head: f swap32x4 s1
    (248320, 4096): GemmPlan(128, 128, 32, 8, 3, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-0.8b gdn in_proj (fused): e swap32x4 s1
    (8224, 1024): GemmPlan(64, 128, 8, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-0.8b gdn out_proj / attn o_proj / mtp fc: b 16x8 n32 s4
    (1024, 2048): GemmPlan(32, 128, 4, 4, 4, family="stream", row_tiles=8),
    # qwen3.5-0.8b attn qkv (fused): d swap32x8 s3
    (5120, 1024): GemmPlan(128, 64, 6, 8, 4, family="stream", block_m=32, row_tiles=8, swap_ab=True),
    # qwen3.5-0.8b mlp gate_up (fused): e swap32x4 s1
    (7168, 1024): GemmPlan(64, 128, 8, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-0.8b mlp down: e swap32x4 s7
    (1024, 3584): GemmPlan(64, 128, 4, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True),
    # qwen3.5-0.8b lm_head: grid64 s1
    (248320, 1024): GemmPlan(128, 64, 16, 4, 4, block_m=64),
}


# W8A16 plans (fp8 weights): `benchmarks/gemm_fp8.py --family` times the plan family on the GPU and
# `benchmarks/apply_plans.py --fp8 REPORT` writes the winners here; a shape not here takes its bf16 plan.
TUNED_FP8: dict[tuple[int, int], GemmPlan] = {
    # qwen3.5-27b gdn in_proj qkv+z: d swap64x2 s1
    (16384, 5120): GemmPlan(128, 128, 40, 8, 3, family="stream", block_m=64, row_tiles=2, swap_ab=True),
    # qwen3.5-27b gdn out_proj / attn o_proj: d swap64x2 s3
    (5120, 6144): GemmPlan(128, 128, 16, 8, 3, family="stream", block_m=64, row_tiles=2, swap_ab=True),
    # qwen3.5-27b attn qkv: d swap64x2 s1
    (14336, 5120): GemmPlan(128, 128, 40, 8, 3, family="stream", block_m=64, row_tiles=2, swap_ab=True),
    # qwen3.5-27b mlp gate_up: d swap64x2 s1
    (34816, 5120): GemmPlan(128, 128, 40, 8, 3, family="stream", block_m=64, row_tiles=2, swap_ab=True),
    # qwen3.5-27b mlp down: d swap64x2 s3
    (5120, 17408): GemmPlan(128, 128, 46, 8, 3, family="stream", block_m=64, row_tiles=2, swap_ab=True),
}


def gemm_plan_fp8(n: int, k: int) -> GemmPlan:
    """The W8A16 plan for an [N, K] fp8 weight: tuned, else the bf16 plan of the shape."""
    return TUNED_FP8.get((n, k)) or gemm_plan(n, k)


def gemm_plan(n: int, k: int) -> GemmPlan:
    """The tuned plan for this shape, else the sweep's lessons: a weight with a handful of output tiles
    (in_proj_a/b) splits K into many short pieces; others split K at most 4 ways, enough to fill the GPU
    (every split adds a partial sum the last program has to read back)."""
    if (n, k) in TUNED:
        return TUNED[n, k]
    block_n, block_k = (32 if n >= 4096 else 16), 128
    tiles, k_blocks = -(-n // block_n), -(-k // block_k)
    if tiles < 8:
        return GemmPlan(block_n, block_k, min(2, k_blocks))
    splits = max(1, min(4, k_blocks, TARGET_PROGRAMS // tiles))
    return GemmPlan(block_n, block_k, -(-k_blocks // splits))


# Wider row tiles for launches of more rows (issue #13): (N, K) -> ((fewest rows, plan), ...) by rising bound. A
# launch of M rows runs the last plan whose bound is <= M, and the shape's `gemm_plan` below the first bound. Every
# plan of a shape makes its `gemm_plan`'s sums (`same_sums`, checked at import), so a row's bits never depend on
# the bucket its launch fell in. `benchmarks/gemm_buckets.py --set buckets --apply` times the candidates on the GPU
# and writes this table; a shape not here runs its one plan at every M.
# BEGIN ROW_BUCKETS (written by benchmarks/gemm_buckets.py --apply)
ROW_BUCKETS: dict[tuple[int, int], tuple[tuple[int, GemmPlan], ...]] = {
    (1024, 3584): (
        (33, GemmPlan(64, 128, 4, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(64, 128, 4, 4, 3, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(64, 64, 8, 4, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (4096, 4096): (
        (33, GemmPlan(64, 128, 16, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(64, 64, 32, 4, 6, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(64, 64, 32, 4, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (4096, 8192): (
        (33, GemmPlan(64, 128, 32, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(64, 64, 64, 4, 6, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(64, 64, 64, 4, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (4096, 12288): (
        (33, GemmPlan(64, 64, 96, 4, 8, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(64, 64, 96, 4, 6, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(64, 64, 96, 4, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (5120, 1024): (
        (33, GemmPlan(128, 64, 6, 8, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 64, 6, 8, 3, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(128, 64, 6, 8, 3, family="stream", block_m=256, swap_ab=True)),
    ),
    (5120, 6144): (
        (33, GemmPlan(128, 64, 32, 8, 6, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 64, 32, 8, 6, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(128, 64, 32, 8, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (5120, 10240): (
        (33, GemmPlan(128, 64, 54, 8, 6, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 64, 54, 8, 6, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(128, 64, 54, 8, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (5120, 17408): (
        (33, GemmPlan(128, 128, 46, 8, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 64, 92, 8, 6, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(128, 64, 92, 8, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (7168, 1024): (
        (33, GemmPlan(64, 128, 8, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(64, 128, 8, 4, 3, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(64, 64, 16, 4, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (8224, 1024): (
        (33, GemmPlan(64, 128, 8, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(64, 128, 8, 4, 3, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(64, 64, 16, 4, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (10240, 4096): (
        (33, GemmPlan(128, 64, 22, 4, 4, block_m=64)),
        (65, GemmPlan(128, 64, 22, 8, 6, family="stream", block_m=128)),
        (129, GemmPlan(128, 64, 22, 8, 4, family="stream", block_m=256)),
    ),
    (12352, 4096): (
        (33, GemmPlan(128, 64, 32, 4, 4, block_m=64)),
        (65, GemmPlan(128, 64, 32, 8, 6, family="stream", block_m=128)),
        (129, GemmPlan(128, 64, 32, 4, 4, block_m=64)),
    ),
    (14336, 5120): (
        (33, GemmPlan(128, 64, 80, 8, 6, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 64, 80, 8, 5, family="stream", block_m=128)),
        (129, GemmPlan(128, 64, 80, 8, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (16480, 5120): (
        (33, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 64, 80, 8, 6, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(128, 64, 80, 8, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (24576, 4096): (
        (33, GemmPlan(64, 128, 32, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(256, 64, 64, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 64, 64, 8, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (34816, 5120): (
        (33, GemmPlan(64, 64, 80, 4, 6, family="stream", block_m=64, swap_ab=True, tail_tiles=16, tail_splits=8)),
        (65, GemmPlan(128, 64, 80, 8, 5, family="stream", block_m=128, tail_tiles=8, tail_splits=8)),
        (129, GemmPlan(128, 64, 80, 8, 4, family="stream", block_m=256, swap_ab=True, tail_tiles=8, tail_splits=8)),
    ),
    (248320, 1024): (
        (33, GemmPlan(128, 64, 16, 4, 4, block_m=64)),
        (65, GemmPlan(256, 64, 16, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 64, 16, 8, 4, family="stream", block_m=256)),
    ),
    (248320, 4096): (
        (33, GemmPlan(128, 128, 32, 8, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(256, 64, 64, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 64, 64, 8, 4, family="stream", block_m=256, swap_ab=True)),
    ),
    (248320, 5120): (
        (33, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(256, 64, 80, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 64, 80, 8, 3, family="stream", block_m=256, swap_ab=True)),
    ),
}
# END ROW_BUCKETS


def sum_order(plan: GemmPlan, n: int, k: int) -> tuple:
    """What fixes the value of every output element of an [N, K] weight's product, measured on the H200
    (benchmarks/gemm_buckets.py: 27B shapes, rows bitwise equal at M = 256 across plans): the K split points (in K
    elements), the split tail's first column and K split points, and the MMA: among wgmma plans neither the row
    tile (the MMA's N when swapped), the weight tile, swapping, the warps, the K block nor the pipeline depth changes
    a bit (each element's K blocks go into the same fp32 accumulator in the same k16 steps, in order). mma.sync
    groups K inside an MMA by its operand layout (docs/gpu-findings.md), which was not measured across tiles: an
    mma.sync plan sums as another only with the same tiles."""
    tail = stream_tail(plan, n, k) if plan.family == "stream" else {}
    tail_start = (-(-n // plan.block_n) - tail["TAIL_TILES"]) * plan.block_n if tail else n
    tail_k = tail.get("TAIL_K_PER_SPLIT", 0) * plan.block_k
    mma = "wgmma"
    if feeds_mma_sync(plan, 9):
        mma = ("mma.sync", plan.block_m, plan.block_n, plan.block_k, plan.num_warps, plan.swap_ab)
    split = min(plan.k_per_split * plan.block_k, k)  # K elements per split (all of K: one split)
    return split, tail_start, tail_k, mma


def same_sums(a: GemmPlan, b: GemmPlan, n: int, k: int) -> bool:
    """Whether two plans give every element of an [N, K] weight's product the same bits (`sum_order`)."""
    return sum_order(a, n, k) == sum_order(b, n, k)


def bucket_of(entries: tuple[tuple[int, GemmPlan], ...], m: int, plan: GemmPlan) -> tuple[GemmPlan, int]:
    """A launch of `m` rows in a shape's row buckets (`entries`, bounds rising): the plan of the last bucket it
    reaches and that bucket's first row; `plan` and 1 below every bucket."""
    start = 1
    for fewest, bucket in entries:
        if m >= fewest:
            plan, start = bucket, fewest
    return plan, start


def row_plan(
    n: int, k: int, m: int, hopper: bool = True, buckets: dict | None = None, base=None, loads: dict | None = None
) -> GemmPlan:
    """The decode plan a launch of `m` rows of an [N, K] bf16 weight runs: its row bucket's, else `gemm_plan`, with
    its tiles loaded by TMA where `TMA_LOAD_BUCKETS` (or `QWEN_MTP_TMA_LOADS`) says and its first `L2_PREFETCH` K
    blocks asked of L2 before the PDL wait (a launch without PDL asks nothing: `l2_prefetch_columns`). The buckets
    only on Hopper (`hopper`), where `sum_order` was measured; elsewhere the one plan serves every M. `buckets`,
    `base` and `loads`: another kernel's tables and per-shape plan (W8A8: `W8A8_ROW_BUCKETS`, `gemm_plan_w8a8`,
    `TMA_LOAD_BUCKETS["w8a8"]`)."""
    table = ROW_BUCKETS if buckets is None else buckets
    loads = (TMA_LOAD_BUCKETS["bf16"] if buckets is None else {}) if loads is None else loads
    plan, bucket_start = bucket_of(table.get((n, k), ()) if hopper else (), m, (base or gemm_plan)(n, k))
    tma = hopper and bucket_start in loads.get((n, k), ()) if TMA_LOADS is None else TMA_LOADS
    if plan.family == "tma":
        return plan
    return replace(plan, tma_loads=tma, l2_prefetch=L2_PREFETCH or plan.l2_prefetch)


def l2_prefetch_columns(plan: GemmPlan, weight: torch.Tensor, pdl: bool) -> dict:
    """The launch's `prefetch_weight_rows` constexprs: the plan's `l2_prefetch` K blocks (at most one K split, at
    most K) as columns and bytes a weight row, where the prefetch can help and is allowed: a launch with
    programmatic dependent launch (`pdl`, else no kernel runs early), on a weight whose row starts and sizes are
    16-byte multiples (the bulk prefetch's rule). Else zeros: no prefetch."""
    k = weight.shape[1]
    columns = min(plan.l2_prefetch, plan.k_per_split) * plan.block_k
    columns = min(columns, k // plan.block_k * plan.block_k)
    size, row, stride = (count * weight.element_size() for count in (columns, k, weight.stride(0)))
    aligned = size % 16 == 0 and row % 16 == 0 and stride % 16 == 0 and weight.data_ptr() % 16 == 0
    if not (pdl and columns and aligned):
        return {"L2_PREFETCH_K": 0, "L2_PREFETCH_BYTES": 0}
    return {"L2_PREFETCH_K": columns, "L2_PREFETCH_BYTES": size}


def check_row_buckets(buckets: dict[tuple[int, int], tuple[tuple[int, GemmPlan], ...]], base=None) -> None:
    """Every bucket plan sums as its shape's `gemm_plan` (or `base`) does, and the bounds rise: else a ValueError."""
    base = base or gemm_plan
    for (n, k), entries in buckets.items():
        bounds = [fewest for fewest, _ in entries]
        if bounds != sorted(set(bounds)) or bounds[0] < 2:
            raise ValueError(f"row buckets of {n}x{k}: row bounds must rise from 2 or more, got {bounds}")
        for fewest, plan in entries:
            if not same_sums(plan, base(n, k), n, k):
                raise ValueError(
                    f"row buckets of {n}x{k} from {fewest} rows: {plan} sums otherwise than {base.__name__}"
                )


# Prefill plans (`prefill_rows`), measured on the H200 by `benchmarks/gemm_prefill.py --apply` (2026-12-03, twelfth
# session: docs/img/gemm-prefill-27b-twelfth.json): the "tma" kernel with 128 x 256 tiles, one forward's 27B linears
# 0.99x cuBLAS at M = 2048, 0.93x at 4096, 0.96x at 8192, 1.27x at 512 (the "grid" default: 1.24-1.68x). A shape not
# here takes `grid_prefill_plan`.
PREFILL_TUNED: dict[tuple[int, int], GemmPlan] = {
    (16480, 5120): GemmPlan(256, 64, 80, 8, 3, family="tma", block_m=128, group_m=16),  # 27b gdn in_proj
    (5120, 6144): GemmPlan(256, 64, 96, 8, 3, family="tma", block_m=128),  # 27b o_proj / gdn out_proj
    (14336, 5120): GemmPlan(256, 64, 80, 8, 3, family="tma", block_m=128, persistent=True),  # 27b attn qkv
    (34816, 5120): GemmPlan(256, 64, 80, 8, 3, family="tma", block_m=128, persistent=True),  # 27b mlp gate_up
    (5120, 17408): GemmPlan(256, 64, 272, 8, 3, family="tma", block_m=128, persistent=True),  # 27b mlp down
}
# Prefill row buckets: a prefill launch of at least `fewest` rows runs the bucket's plan instead of the shape's
# `prefill_gemm_plan`, which every bucket plan sums as (one K split, wgmma: `check_row_buckets` at import), so a row's
# bits are the same at every M. Why: a plan's tiles suit some row counts; at M = 512 the N = 5120 shapes have 80-160
# 128 x 256 tiles for 132 SMs (1.47-1.57x cuBLAS, docs/benchmark-log.md) while thousands of rows want the large tiles.
# BEGIN PREFILL_ROW_BUCKETS (written by benchmarks/gemm_prefill.py --apply)
PREFILL_ROW_BUCKETS: dict[tuple[int, int], tuple[tuple[int, GemmPlan], ...]] = {}
# END PREFILL_ROW_BUCKETS
# W8A8 prefill plans: packed prefill rows of an FP8 weight (`prefill_rows`, `FP8_PREFILL` "scaled_mm": the product
# unpacked prefills run through cuBLASLt) on the "tma" kernel, e4m3 rows and weights, one K split of 128-deep scaled
# blocks, so a row's bits never depend on M. Why not the W8A16 "grid" stand-in: a bf16 MMA after an in-register
# dequantization, it ran the 27B FP8 packed chunk step at 99.5 ms against 46.7 ms unpacked (H200, twentieth
# session). Written by `benchmarks/gemm_prefill_fp8.py --apply` (H200, twentieth session: docs/img/
# gemm-prefill-fp8-27b-twentieth.json): one 27B forward's FP8 linears 42.2 / 137.6 / 289.0 ms at M = 512 / 2048 /
# 4096, against 25.9 / 82.7 / 167.7 for scaled_mm (1.63-1.72x), 32.9 / 129.5 / 271.0 for cuBLAS bf16 and
# 103.1 / 314.1 / 576.1 for the W8A16 "grid" plan. A shape not here takes `prefill_plan_w8a8`'s default.
PREFILL_TUNED_W8A8: dict[tuple[int, int], GemmPlan] = {
    (16384, 5120): GemmPlan(128, 128, 40, 4, 4, family="tma", block_m=64),
    (5120, 6144): GemmPlan(128, 128, 48, 4, 4, family="tma", block_m=64),
    (14336, 5120): GemmPlan(128, 128, 40, 4, 4, family="tma", block_m=64),
    (34816, 5120): GemmPlan(128, 128, 40, 4, 4, family="tma", block_m=64),
    (5120, 17408): GemmPlan(128, 128, 136, 4, 4, family="tma", block_m=64),
}
_PREFILL_ROWS: ContextVar[bool] = ContextVar("qwen_mtp_prefill_rows", default=False)


def prefill_plan_w8a8(n: int, k: int) -> GemmPlan:
    """The W8A8 plan of packed prefill rows of an e4m3 [N, K] weight: tuned, else 128 x 128 tiles of 128-deep
    blocks on the "tma" kernel, its whole K loop in one program."""
    return PREFILL_TUNED_W8A8.get((n, k)) or GemmPlan(
        128, FP8_BLOCK[1], -(-k // FP8_BLOCK[1]), 8, 4, family="tma", block_m=128
    )


def prefill_gemm_plan(n: int, k: int) -> GemmPlan:
    """The invariant plan for prefill row counts (`prefill_rows`): tuned, else `grid_prefill_plan`; a launch of
    more rows may run a row bucket's plan that sums alike (`prefill_row_plan`)."""
    return PREFILL_TUNED.get((n, k)) or grid_prefill_plan(n, k)


def prefill_row_plan(n: int, k: int, m: int) -> GemmPlan:
    """The prefill plan a launch of `m` rows runs: its row bucket's (`PREFILL_ROW_BUCKETS`), else
    `prefill_gemm_plan`. Only where the "tma" kernel runs (Hopper), where `sum_order` was measured."""
    return bucket_of(PREFILL_ROW_BUCKETS.get((n, k), ()), m, prefill_gemm_plan(n, k))[0]


def grid_prefill_plan(n: int, k: int) -> GemmPlan:
    """ "grid" with 128 x 128 tiles and the whole K loop in one program (no split: at prefill M there are tiles
    enough to fill the GPU, and no partial sums to park): for shapes not measured, and where a "tma" plan cannot
    run (FP8 weights, GPUs before Hopper). With one K split and 64-row MMAs it sums as the "tma" plans do
    (`same_sums`)."""
    return GemmPlan(128, 64, -(-k // 64), num_warps=8, num_stages=3, block_m=128)


@contextmanager
def prefill_rows() -> Iterator[None]:
    """Inside this block the invariant GEMMs (bf16 and W8A16) run the prefill plans (`prefill_gemm_plan`): for
    eager packed prefills (read when each op runs, so a CUDA graph or compiled step keeps what it was built
    with; the decode path is never built inside it)."""
    token = _PREFILL_ROWS.set(True)
    try:
        yield
    finally:
        _PREFILL_ROWS.reset(token)


def _invariant_plan(n: int, k: int, device: torch.device, fp8: bool = False, m: int = 1) -> GemmPlan | None:
    """The plan an invariant GEMM of this shape over `m` rows runs now: inside `prefill_rows` the prefill plan (its
    row bucket's where the "tma" kernel runs; for FP8 weights the W8A8 "tma" plan where prefills run W8A8
    (`prefill_plan_w8a8`); the W8A16 "grid" stand-in where a "tma" plan cannot run), else None (the decode plan,
    `gemm_plan` / `gemm_plan_fp8` / `gemm_plan_w8a8`)."""
    if not _PREFILL_ROWS.get():
        return None
    if fp8 and FP8_PREFILL == "scaled_mm" and tma_available(device) and tma_w8a8_supported(n, k):
        return prefill_plan_w8a8(n, k)
    if not fp8 and tma_available(device):
        return prefill_row_plan(n, k, m)
    plan = prefill_gemm_plan(n, k)
    return grid_prefill_plan(n, k) if plan.family == "tma" else plan


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _matmul_kernel():
    """The "grid" family: a program per (row tile, N tile, K split)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one binary whatever the row count
    def matmul_grid(
        x_ptr, w_ptr, wp_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
        sx_m, sw_n, ss_n, so_m, k_per_split,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FP8: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, MMA_SYNC: tl.constexpr = False,
        L2_PREFETCH_K: tl.constexpr = 0, L2_PREFETCH_BYTES: tl.constexpr = 0, TMA: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.prefetch_weight_rows(wp_ptr, tl.program_id(1) * BLOCK_N, tl.program_id(2) * k_per_split * BLOCK_K,
                                          N, K, sw_n, BLOCK_N, L2_PREFETCH_K, L2_PREFETCH_BYTES)  # fmt: skip
        # TMA: x_ptr and w_ptr are tensor descriptors (`GemmPlan.tma_loads`), as in the stream family; wp_ptr is
        # the weight's address either way (the prefetch's).
        # FP8: w_ptr is e4m3 and s_ptr its block scales [ceil(N/128), ceil(K/128)] (row stride ss_n); each weight
        # tile is dequantized to the activations' dtype in registers (`triton_utils.fp8_dequantize`).
        # Row tiles of one weight tile are neighbours in launch order, so a weight tile read from HBM serves
        # every row tile from L2.
        triton_utils.wait_for_previous_kernel(PDL)
        pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start = split * k_per_split * BLOCK_K
        k_end = tl.minimum(K, k_start + k_per_split * BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
            kmask = (k0 + ks) < k_end
            if TMA:
                x = x_ptr.load([pid_m * BLOCK_M, k0])
                w = w_ptr.load([pid_n * BLOCK_N, k0])
            else:
                x = tl.load(
                    x_ptr + ms[:, None] * sx_m + (k0 + ks)[None, :], mask=(ms[:, None] < M) & kmask[None, :], other=0.0
                )
                w = tl.load(
                    w_ptr + ns[:, None] * sw_n + (k0 + ks)[None, :], mask=(ns[:, None] < N) & kmask[None, :], other=0.0
                )
            if FP8:
                w = triton_utils.fp8_dequantize(
                    w, s_ptr, ns, k0, ss_n, N, K, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, INTERPRETED, MMA_SYNC
                )
            acc += triton_utils.dot(x, tl.trans(w), INTERPRETED, PRECISION)
        tile = ms[:, None] * N + ns[None, :]
        mask = (ms[:, None] < M) & (ns[None, :] < N)
        if SPLITS == 1:
            tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # Split K: park this split's partial sum; the tile's last split to finish (whichever it is) adds
            # all SPLITS partials in split order 0, 1, ..., so the sum never depends on timing or on M, and
            # no second kernel launch is needed. It then re-arms the tile's counter for the next launch.
            tl.store(part_ptr + split * M * N + tile, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is stored before the (release) counter update
            counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                total = tl.load(part_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, SPLITS):
                    total += tl.load(part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter, 0, sem="relaxed")

    return matmul_grid


@functools.cache
def _stream_kernel():
    """The "stream" family: a program per (N tile, K split) that reads its weight slice from HBM once for every
    `row_tiles x block_m` rows, instead of once per `block_m` rows.

    The program walks the rows in groups of up to ROW_TILES tiles of BLOCK_M rows. For a group it runs its K
    range once: each weight block [BLOCK_N, BLOCK_K] is loaded once and multiplied into the accumulator of
    every tile of the group (one `tl.dot` of [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] per tile). A group holding
    fewer tiles (the last, or the only one at small M) runs a loop compiled for exactly that many tiles (chosen
    at run time from the ROW_TILES loops in the one binary), so one row does not pay for the MMAs of absent
    tiles. Rows past one group re-read the weight slice (from L2 while it fits there); ROW_TILES comes from the
    plan, so the number of rows that share a read is a function of (N, K), like everything else.

    SWAP_AB computes each tile transposed, [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]: the weight block is the MMA's
    row side (64 rows fill a Hopper wgmma) and the rows its column side, which wgmma allows as narrow as 8, so a
    16-row tile does not pay for 64 rows of MMA work at M = 1 as the unswapped 64-row tile does.

    Why a row's result never depends on M: every `tl.dot` has the same shape (whatever the tile count, hence the
    same MMA instruction and warp layout), a row only ever meets its own accumulator, its K blocks are added in
    one order (k_start upwards), the K splits are a function of (N, K) and their partials are added in split
    order 0, 1, ... (by whichever split program finishes a row group last), and one binary serves every M (M is
    not specialised). Absent rows are zero-padded tiles that only their own accumulator sees. The K loop of each
    tile count has its own pipeline depth (STAGES, WIDE_STAGES: `stream_stages`), which moves loads only.
    """
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one binary whatever the row count
    def matmul_stream(
        x_ptr, w_ptr, wp_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
        sx_m, sw_n, ss_n, so_m, k_per_split,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        ROW_TILES: tl.constexpr, SWAP_AB: tl.constexpr, FP8: tl.constexpr, INTERPRETED: tl.constexpr,
        PRECISION: tl.constexpr, MMA_SYNC: tl.constexpr = False,
        STAGES: tl.constexpr = 3, WIDE_STAGES: tl.constexpr = 3,  # K loop pipeline depths (`stream_stages`)
        TAIL_TILES: tl.constexpr = 0, TAIL_SPLITS: tl.constexpr = 1, TAIL_K_PER_SPLIT: tl.constexpr = 0,
        L2_PREFETCH_K: tl.constexpr = 0, L2_PREFETCH_BYTES: tl.constexpr = 0, TMA: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # L2_PREFETCH_K: a split tail's programs (their tiles and K ranges are worked out below) ask for blocks of
        # other tiles or none of use: a wasted request, never a wrong one.
        triton_utils.prefetch_weight_rows(wp_ptr, tl.program_id(0) * BLOCK_N, tl.program_id(1) * k_per_split * BLOCK_K,
                                          N, K, sw_n, BLOCK_N, L2_PREFETCH_K, L2_PREFETCH_BYTES)  # fmt: skip
        # FP8: as in the grid family; each weight block is dequantized once, for every row tile of the group.
        # TMA: x_ptr and w_ptr are tensor descriptors of [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] blocks
        # (`GemmPlan.tma_loads`): the same tiles, copied by the tensor memory accelerator; wp_ptr is the weight's
        # address either way (the prefetch's).
        triton_utils.wait_for_previous_kernel(PDL)
        pid_n, split = tl.program_id(0), tl.program_id(1)
        # k_blocks: this program's K blocks per split; n_splits: its tile's split count; part_n, part_n0: the
        # partial sums' row length and first column
        if TAIL_SPLITS > 1:  # the last TAIL_TILES tiles: TAIL_SPLITS programs each (the plan has one split)
            main = tl.cdiv(N, BLOCK_N) - TAIL_TILES
            tail, nth = pid_n >= main, pid_n - main  # nth: this program's place among the tail's programs
            pid_n, split = tl.where(tail, main + nth // TAIL_SPLITS, pid_n), tl.where(tail, nth % TAIL_SPLITS, 0)
            k_blocks, n_splits = tl.where(tail, TAIL_K_PER_SPLIT, k_per_split), tl.where(tail, TAIL_SPLITS, 1)
            part_n, part_n0 = TAIL_TILES * BLOCK_N, main * BLOCK_N
        else:
            k_blocks, part_n, part_n0 = k_per_split, N, 0
            # Annotated: a plain assignment makes a tensor, and an `if` on a tensor compiles both its paths. As a
            # constexpr, a launch without a tail compiles only its own; at one split part_ptr and count_ptr are the
            # bf16 output, on which the split reduction's atomics do not compile.
            n_splits: tl.constexpr = SPLITS
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows, ks = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K)
        k_start = split * k_blocks * BLOCK_K
        k_end = tl.minimum(K, k_start + k_blocks * BLOCK_K)
        plane = M.to(tl.int64) * part_n  # elements of one split's partial sums [M, part_n] (split tiles)
        part = part_ptr + split * plane
        for row0 in range(0, M, ROW_TILES * BLOCK_M):
            live = tl.minimum(tl.cdiv(M - row0, BLOCK_M), ROW_TILES)  # row tiles of this group holding rows
            for tiles in tl.static_range(1, ROW_TILES + 1):
                if live == tiles:
                    acc0 = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
                    accs = (acc0,) * tiles
                    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES if tiles == 1 else WIDE_STAGES):
                        kmask = (k0 + ks) < k_end
                        if TMA:  # w_ptr is a descriptor; K splits end on BLOCK_K boundaries, past N and K reads 0
                            w = w_ptr.load([pid_n * BLOCK_N, k0])
                        else:
                            w = tl.load(
                                w_ptr + ns[:, None] * sw_n + (k0 + ks)[None, :],
                                mask=(ns[:, None] < N) & kmask[None, :], other=0.0,
                            )  # fmt: skip
                        if FP8:
                            w = triton_utils.fp8_dequantize(
                                w, s_ptr, ns, k0, ss_n, N, K, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, INTERPRETED,
                                MMA_SYNC,
                            )  # fmt: skip
                        updated = ()
                        for t in tl.static_range(tiles):
                            ms = row0 + t * BLOCK_M + rows
                            if TMA:
                                x = x_ptr.load([row0 + t * BLOCK_M, k0])
                            else:
                                x = tl.load(
                                    x_ptr + ms[:, None] * sx_m + (k0 + ks)[None, :],
                                    mask=(ms[:, None] < M) & kmask[None, :], other=0.0,
                                )  # fmt: skip
                            if SWAP_AB:
                                prod = triton_utils.dot(w, tl.trans(x), INTERPRETED, PRECISION)  # [BLOCK_N, BLOCK_M]
                            else:
                                prod = triton_utils.dot(x, tl.trans(w), INTERPRETED, PRECISION)  # [BLOCK_M, BLOCK_N]
                            updated = updated + (accs[t] + prod,)
                        accs = updated
                    for t in tl.static_range(tiles):
                        acc = tl.trans(accs[t]) if SWAP_AB else accs[t]  # [BLOCK_M, BLOCK_N]
                        ms = (row0 + t * BLOCK_M + rows).to(tl.int64)
                        mask = (ms[:, None] < M) & (ns[None, :] < N)
                        if n_splits == 1:
                            out = acc.to(out_ptr.dtype.element_ty)
                            tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], out, mask=mask)
                        else:
                            tl.store(part + ms[:, None] * part_n + (ns - part_n0)[None, :], acc, mask=mask)
            if n_splits > 1:  # known when compiling, except in a split tail (runtime, per program)
                # As in the grid family, the last of the tile's programs to finish this group's partial sums
                # adds them in split order 0, 1, ...: per group, so these sums overlap the other groups' MMAs.
                tl.debug_barrier()  # every thread's partials are stored before the (release) counter update
                counter = count_ptr + pid_n * tl.cdiv(M, ROW_TILES * BLOCK_M) + row0 // (ROW_TILES * BLOCK_M)
                if tl.atomic_add(counter, 1, sem="acq_rel") == n_splits - 1:
                    for r0 in range(row0, tl.minimum(M, row0 + ROW_TILES * BLOCK_M), BLOCK_M):
                        ms = (r0 + rows).to(tl.int64)
                        mask = (ms[:, None] < M) & (ns[None, :] < N)
                        tile = ms[:, None] * part_n + (ns - part_n0)[None, :]
                        total = tl.load(part_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
                        for s in range(1, n_splits):
                            total += tl.load(part_ptr + s * plane + tile, mask=mask, other=0.0, cache_modifier=".cg")
                        out = total.to(out_ptr.dtype.element_ty)
                        tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], out, mask=mask)
                    tl.atomic_xchg(counter, 0, sem="relaxed")

    return matmul_stream


@functools.cache
def _tma_kernel():
    """The "tma" family, for prefill row counts (hundreds to thousands of rows): a program per output tile, or
    with `persistent` a program per SM walking the tiles, each tile's whole K loop in one program (one K split).

    Why its own kernel: the "grid" kernel (masked pointer loads, tiles in plain launch order) left a dense prefill
    GEMM at 1.2-2.1x cuBLAS on the H200 (M = 512..8192, 27B shapes); this one 0.89-1.24x per shape from 2048 rows
    (0.93-0.99x for a forward, `benchmarks/gemm_prefill.py`). Here the Hopper tensor memory accelerator copies each
    [BLOCK_M, BLOCK_K] row block and [BLOCK_N, BLOCK_K] weight block into shared memory (out-of-range rows and
    columns read as zeros, so there are no masks), as cuBLAS does. Tiles go out in groups of GROUP_M row tiles that
    walk the N tiles together, so a weight tile read from HBM serves the group's row tiles from L2.

    Why a row's result never depends on M: its tile's K blocks go into one fp32 accumulator in K order (one
    split), the MMA shape comes from the plan (a function of (N, K)), M is not specialised, and which program runs
    a tile (its launch order) moves no bit. Zero-padded rows meet only their own accumulator rows.
    """
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one binary whatever the row count
    def matmul_tma(
        x_desc, w_desc, out_desc, xs_ptr, ws_ptr, M, N, K, sxs_m, sws_n,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr, W8A8: tl.constexpr = False, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # W8A8: x and w are e4m3, xs_ptr their rows' 1x128 scales [M, K/128] (row stride sxs_m) and ws_ptr the
        # weight's 128x128 block scales (row stride sws_n); BLOCK_K is one scale group (128). Each block's product
        # starts from zero and joins the fp32 accumulator scaled, by one fused multiply-add (as in `_w8a8_kernel`).
        triton_utils.wait_for_previous_kernel(PDL)
        m_tiles, n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * n_tiles  # tiles of one group of row tiles
        for tile in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0)):
            first_m = tile // per_group * GROUP_M
            group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
            pid_m = first_m + tile % per_group % group_rows
            pid_n = tile % per_group // group_rows
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # the tile's rows and columns (W8A8: their scales)
            ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            for k0 in range(0, K, BLOCK_K):
                x = x_desc.load([pid_m * BLOCK_M, k0])
                w = w_desc.load([pid_n * BLOCK_N, k0])
                if W8A8:
                    x_scale = tl.load(xs_ptr + ms * sxs_m + k0 // BLOCK_K, mask=ms < M, other=0.0)
                    w_scale = tl.load(ws_ptr + (ns // 128) * sws_n + k0 // BLOCK_K, mask=ns < N, other=0.0)
                    prod = triton_utils.dot(x, tl.trans(w), INTERPRETED, "ieee")
                    acc = tl.fma(prod, x_scale[:, None] * w_scale[None, :], acc)
                else:
                    acc += triton_utils.dot(x, tl.trans(w), INTERPRETED, PRECISION)
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))

    return matmul_tma


def tma_available(device: torch.device) -> bool:
    """Whether the "tma" kernel runs on `device`: Hopper (sm_90) or later, or the interpreter (the CPU tests)."""
    return INTERPRET or (device.type == "cuda" and triton_utils.hopper_or_later(device))


def tma_supported(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a "tma" plan runs an [N, K] weight in `dtype` (rows of x, the weight and the output start on 16-byte
    boundaries, as the tensor memory accelerator needs); a function of the shape, so a row's kernel never depends
    on where its tensors happen to lie."""
    size = dtype.itemsize
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and (k * size) % 16 == 0 and (n * size) % 16 == 0


def tma_w8a8_supported(n: int, k: int, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the "tma" kernel runs W8A8 on an e4m3 [N, K] weight: K whole 128-column scale groups (e4m3 rows
    then start on 16-byte boundaries) and output rows of 16-byte multiples."""
    return k % FP8_BLOCK[1] == 0 and (n * out_dtype.itemsize) % 16 == 0


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    """A host tensor descriptor of a row-major matrix, copied in [block_rows, block_cols] blocks."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [block_rows, block_cols])


def _tile_descriptors(x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan) -> tuple | None:
    """Tensor descriptors of x's [block_m, block_k] and the weight's [block_n, block_k] blocks; None for a weight
    view at an odd offset (the tensor memory accelerator reads from 16-byte boundaries; x, small, is copied)."""
    if weight.data_ptr() % 16:
        return None
    x = x if x.data_ptr() % 16 == 0 else x.clone()  # the same numbers, aligned
    return _descriptor(x, plan.block_m, plan.block_k), _descriptor(weight, plan.block_n, plan.block_k)


def _tma_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    plan: GemmPlan,
    x_scale: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """out = x @ weight^T by the "tma" kernel (`_tma_kernel`); with scales, x and weight are e4m3 (W8A8: x_scale
    [M, K/128] row-major, scale the weight's [ceil(N/128), K/128] block scales)."""
    import triton

    (m, k), n = x.shape, weight.shape[0]
    w8a8 = scale is not None
    aligned = tma_w8a8_supported(n, k, out.dtype) if w8a8 else tma_supported(n, k, x.dtype)
    if plan.splits(k) != 1 or not aligned:
        raise ValueError(f"a 'tma' plan runs one K split of a 16-byte-aligned shape: {plan} on {n}x{k} {x.dtype}")
    x_tiles, w_tiles = _tile_descriptors(x, weight, plan) or _tile_descriptors(x, weight.clone(), plan)
    tiles = triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n)
    programs = min(tiles, _sm_count(x.device)) if plan.persistent and x.is_cuda else tiles
    xs, ws = (x_scale, scale) if w8a8 else (out, out)  # without scales: pointers the kernel never reads
    _tma_kernel()[(programs,)](
        x_tiles, w_tiles, _descriptor(out, plan.block_m, plan.block_n), xs, ws, m, n, k, xs.stride(0), ws.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=plan.group_m,
        INTERPRETED=INTERPRET, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", W8A8=w8a8,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **triton_utils.launch(x.device),
    )  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: zeroed split counters, re-armed by the kernel
_OUTGROWN: list[torch.Tensor] = []  # counters a larger call replaced: captured graphs still use them, keep them


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        # Allocated before any graph capture (in the warm-up run) at a fixed address. An eager call with more
        # tiles (a packed prefill's thousands of rows, mixed steps) gets a larger set; the old one stays alive,
        # since the graphs captured with it replay into it.
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
    return counters


def feeds_mma_sync(plan: GemmPlan, arch: int) -> bool:
    """Whether Triton runs the plan's `tl.dot` as mma.sync on a GPU of compute capability `arch`.x rather than as
    Hopper's wgmma, which needs a multiple of 64 MMA rows (the weight block's when swapped) and of 4 warps. The
    W8A16 dequantization needs to know (`triton_helpers.fp8_dequantize`, MMA_SYNC)."""
    rows = plan.block_n if plan.swap_ab else plan.block_m
    return not (arch == 9 and rows % 64 == 0 and plan.num_warps % 4 == 0)


def launch_row_tiles(plan: GemmPlan, m: int) -> int:
    """ROW_TILES for a launch of M rows: the plan's, or fewer where M rows fill fewer tiles. Then the binary lacks
    the loops for tile counts M never reaches (their registers, their spills). Each loop's code is the same in every
    binary, so are a row's bits (one row group, one split counter, either way)."""
    return min(plan.row_tiles, -(-m // plan.block_m))


def stream_stages(plan: GemmPlan) -> dict[str, int]:
    """The stream kernel's pipeline depths: STAGES for its one-row-tile K loop, WIDE_STAGES for the loops of 2+
    row tiles. A program reserves the shared memory of its largest loop (stages x (weight block + row_tiles row
    blocks)), which caps the programs per SM at every M, however few rows a launch has; a shallower wide loop
    leaves room for a deeper one-tile loop (more weight bytes in flight at M <= block_m, one request's decode) in
    the same memory. Depths never change a row's sums: the same MMAs in the same K order, only loads move earlier.
    """
    return {"STAGES": plan.num_stages, "WIDE_STAGES": plan.wide_stages or plan.num_stages}


def stream_tail(plan: GemmPlan, n: int, k: int) -> dict[str, int]:
    """The stream kernel's split tail: the last `tail_tiles` N tiles run `tail_splits` programs each, over K
    ranges of TAIL_K_PER_SPLIT blocks, their partials added in split order by the last to finish (as K splits
    are). A weight of 544 tiles on 132 SMs leaves a last wave of 16 programs streaming alone; split 8 ways those
    16 tiles fill 128 SMs. The split points are a function of (N, K) and the plan, never of M."""
    if not plan.tail_tiles:
        return {}
    n_tiles, k_blocks = -(-n // plan.block_n), -(-k // plan.block_k)
    if plan.splits(k) != 1 or plan.tail_tiles >= n_tiles:
        raise ValueError(f"GemmPlan.tail_tiles needs a plan of one K split and < {n_tiles} tail tiles: {plan}")
    per_split = -(-k_blocks // plan.tail_splits)
    return {"TAIL_TILES": plan.tail_tiles, "TAIL_SPLITS": -(-k_blocks // per_split), "TAIL_K_PER_SPLIT": per_split}


def invariant_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T with a fixed, M-independent reduction order (fp32 accumulation), by the plan's
    kernel family (default: the shape's `row_plan` for M rows, or `gemm_plan_fp8` with a `scale`). With `scale`,
    weight is e4m3 and `scale` its 128x128 block scales (W8A16)."""
    import triton

    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    assert weight.stride(1) == 1
    fp8 = scale is not None
    if fp8:
        assert weight.dtype == torch.float8_e4m3fn and scale.stride(1) == 1
        assert tuple(scale.shape) == (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1])), "scale grid of 128x128 blocks"
    if plan is None and fp8:
        plan = gemm_plan_fp8(n, k)
    elif plan is None:
        plan = row_plan(n, k, m, hopper=INTERPRET or _is_hopper(x.device))
    splits = plan.splits(k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if plan.family == "tma":
        if fp8:
            raise ValueError(f"a 'tma' plan runs bf16, fp16 or fp32 weights, not FP8: {plan}")
        _tma_matmul(x, weight, out, plan)
        return out
    n_tiles = triton.cdiv(n, plan.block_n)
    if plan.family == "grid":
        kernel, grid, extra = _matmul_kernel(), (triton.cdiv(m, plan.block_m), n_tiles, splits), {}
        sums = grid[0] * n_tiles  # one split counter per output tile
    else:
        tail = stream_tail(plan, n, k)
        programs = n_tiles + tail.get("TAIL_TILES", 0) * (tail.get("TAIL_SPLITS", 1) - 1)
        kernel, grid = _stream_kernel(), (programs, splits)
        extra = {"ROW_TILES": plan.row_tiles, "SWAP_AB": plan.swap_ab, **stream_stages(plan), **tail}
        sums = n_tiles * triton.cdiv(m, plan.row_tiles * plan.block_m)  # one per (N tile, row group)
    if plan.family == "stream" and plan.tail_tiles:  # the tail tiles' partials only
        part = torch.empty(tail["TAIL_SPLITS"], m, plan.tail_tiles * plan.block_n, dtype=torch.float32, device=x.device)
    else:
        part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    counters = _tile_counters(x.device, sums) if splits > 1 or plan.tail_tiles else out
    tma = plan.tma_loads and not fp8 and tma_available(x.device) and tma_supported(n, k, x.dtype)
    x_tiles, w_tiles = (tma and _tile_descriptors(x, weight, plan)) or (x, weight)  # a misaligned weight: pointers
    options = triton_utils.launch(x.device)
    extra |= l2_prefetch_columns(plan, weight, options["PDL"])
    kernel[grid](
        x_tiles, w_tiles, weight, scale if fp8 else weight, out, part, counters, m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0) if fp8 else 0, out.stride(0), plan.k_per_split,
        SPLITS=splits, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, **extra,
        FP8=fp8, INTERPRETED=INTERPRET, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        TMA=x_tiles is not x,
        MMA_SYNC=fp8 and not INTERPRET and feeds_mma_sync(plan, torch.cuda.get_device_capability(x.device)[0]),
        num_warps=plan.num_warps, num_stages=plan.num_stages, **options,
    )  # fmt: skip
    return out


@torch.library.custom_op("qwen_mtp::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """Custom op: x [..., K] @ weight [N, K]^T -> [..., N]. `invariant`: each row's reduction order is fixed
    whatever the number of rows (`rowwise_linear` here, the Triton GEMM on CUDA); otherwise `F.linear`."""
    return rowwise_linear(x, weight) if invariant else F.linear(x, weight).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """`qwen_mtp::linear`: `F.linear(x, weight)`, batch-invariant when `invariant` (the decode path)."""
    return linear_op(x, weight, invariant)


@cuda_kernel(linear_op)
def _(x, weight, invariant):
    if not invariant:
        return F.linear(x, weight).contiguous()
    if reference_forced("linear"):
        return rowwise_linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    plan = _invariant_plan(*weight.shape, x.device, m=rows.shape[0])
    return invariant_matmul_triton(rows, weight, plan).reshape(*x.shape[:-1], weight.shape[0])


@linear_op.register_fake
def _(x, weight, invariant):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_linear_backward(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.wants_grad = ctx.needs_input_grad[:2]


def _linear_backward(ctx, grad):
    """grad_x = grad @ W; grad_W = grad^T x over the flattened rows (the invariance flag has no gradient)."""
    x, weight = ctx.saved_tensors
    wants_x, wants_weight = ctx.wants_grad
    grad_x = grad.matmul(weight) if wants_x else None
    grad_weight = None
    if wants_weight:
        grad_weight = grad.reshape(-1, weight.shape[0]).t().matmul(x.reshape(-1, weight.shape[1]))
    return grad_x, grad_weight, None


linear_op.register_autograd(_linear_backward, setup_context=_setup_linear_backward)


# ---- FP8 block weights (W8A16 on the decode path) --------------------------------------------------------------

# The non-invariant (prefill) FP8 GEMM on CUDA, chosen by measurement (benchmarks/gemm_fp8.py, prefill rows):
# "scaled_mm": activations quantized to e4m3 per 1x128 group by one Triton kernel, then cuBLASLt's blockwise
#   `F.scaled_mm` (Hopper, K a multiple of 512; other shapes fall back to "dequantize");
# "dequantize": the weight dequantized by one Triton kernel into a temporary, then cuBLAS (`F.linear`);
# "w8a16": the invariant kernel (then prefill rows would also be batch-invariant).
# Packed prefill rows (mixed steps) are invariant whatever this says: W8A8 on the "tma" kernel for "scaled_mm"
# (`prefill_plan_w8a8`), the W8A16 kernel for the others (`_invariant_plan`).
FP8_PREFILL = "scaled_mm"
FP8_PREFILL_METHODS = ("scaled_mm", "dequantize", "w8a16")


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [..., N, K] + block scales [..., ceil(N/128), ceil(K/128)] -> `dtype`, as transformers dequantizes a
    weight (or each expert of a 3-D one): `(fp8.float() * scale).to(dtype)`."""
    return dequantize_fp8_block(weight, scale).to(dtype)


def linear_fp8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, invariant: bool) -> torch.Tensor:
    """The dequantized weight through the plain linear op's reference (row-wise when `invariant`)."""
    dense = dequantize_weight(weight, scale, x.dtype)
    return rowwise_linear(x, dense) if invariant else F.linear(x, dense).contiguous()


@torch.library.custom_op("qwen_mtp::linear_fp8", mutates_args=())
def linear_fp8_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    invariant: bool,
    w8a8: bool = False,
    x_q: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Custom op: x [..., K] @ dequantized(weight e4m3 [N, K], scale [ceil(N/128), ceil(K/128)])^T -> [..., N]
    in x's dtype; `invariant` as for `qwen_mtp::linear`; `w8a8`: on CUDA the invariant product quantizes the
    activations to e4m3 (the reference, CPU included, is W8A16 either way), or takes them so quantized from the op
    that made x (x_q, x_scale: `quantize_activations_reference(x)`, see `w8a8_input_wanted`)."""
    return linear_fp8_reference(x, weight, scale, invariant)


def linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    invariant: bool = False,
    w8a8: bool = False,
    x_q: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qwen_mtp::linear_fp8`: `linear` with an FP8 block weight; batch-invariant when `invariant`; `w8a8`: the
    CUDA decode path runs W8A8 (`linear_fp8_w8a8_triton`) where the weight allows (`w8a8_supported`), on x_q and
    x_scale when given (x's rows quantized by the op that made them: one launch fewer, the same bits)."""
    return linear_fp8_op(x, weight, scale, invariant, w8a8, x_q, x_scale)


def w8a8_input_wanted(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, w8a8: bool) -> bool:
    """Whether the decode-path product `linear_fp8(x, weight, scale, True, w8a8)` quantizes x for the W8A8 kernel:
    an FP8 weight whose K is whole 1x128 groups, W8A8 chosen, on CUDA, its Triton kernel not forced off. Then the
    op that makes x (a norm, SwiGLU) quantizes it in its own launch and hands it over (`x_q`, `x_scale`). Decided
    from what a compiled step knows when it is traced; packed prefill rows (`prefill_rows`), whose product runs
    the prefill plans and quantizes its own rows, are the caller's to exclude (`cache_api.decode_rows`)."""
    return scale is not None and w8a8 and x.is_cuda and w8a8_supported(weight) and not reference_forced("linear_fp8")


@cuda_kernel(linear_fp8_op)
def _(x, weight, scale, invariant, w8a8=False, x_q=None, x_scale=None):
    if reference_forced("linear_fp8"):
        return linear_fp8_reference(x, weight, scale, invariant)
    rows = x.reshape(-1, x.shape[-1])
    if invariant:
        plan = _invariant_plan(*weight.shape, x.device, fp8=True)  # None: the decode plans
        if (plan.family == "tma") if plan is not None else (w8a8 and w8a8_supported(weight)):  # W8A8
            if x_q is None:
                out = linear_fp8_w8a8_triton(rows, weight, scale, plan)
            else:
                k = weight.shape[1]
                q_scale = x_scale.reshape(-1, k // FP8_BLOCK[1])
                out = w8a8_matmul_triton(x_q.reshape(-1, k), q_scale, weight, scale, plan, x.dtype)
        else:
            out = invariant_matmul_triton(rows, weight, plan, scale=scale)
    else:
        out = _fp8_prefill(rows, weight, scale)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@linear_fp8_op.register_fake
def _(x, weight, scale, invariant, w8a8=False, x_q=None, x_scale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_linear_fp8_backward(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])  # the weight and its scales


def _linear_fp8_backward(ctx, grad):
    """grad_x = grad @ W (dequantized); the FP8 weight and its scales are frozen (no gradient)."""
    weight, scale = ctx.saved_tensors
    return grad.matmul(dequantize_weight(weight, scale, grad.dtype)), None, None, None, None, None, None


linear_fp8_op.register_autograd(_linear_fp8_backward, setup_context=_setup_linear_fp8_backward)


def _fp8_prefill(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if FP8_PREFILL not in FP8_PREFILL_METHODS:
        raise ValueError(f"ops.linear.FP8_PREFILL must be one of {FP8_PREFILL_METHODS}, got {FP8_PREFILL!r}")
    if FP8_PREFILL == "w8a16":
        return invariant_matmul_triton(x, weight, scale=scale)
    if FP8_PREFILL == "scaled_mm" and scaled_mm_supported(x, weight):
        return scaled_mm_linear(x, weight, scale)
    return F.linear(x, dequantize_triton(weight, scale, x.dtype))


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether cuBLASLt's blockwise FP8 GEMM runs this product: Hopper only; bf16 activations; K a multiple of
    512, so the weight scale's K-block count is a multiple of 4 and its transpose is the layout cuBLASLt wants
    (the legacy `torch._scaled_mm` returned inf for other K); N a multiple of 128."""
    n, k = weight.shape
    return (
        hasattr(F, "scaled_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and k % (4 * FP8_BLOCK[1]) == 0
        and n % FP8_BLOCK[0] == 0
        and _is_hopper(x.device)
    )


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8: x quantized per 1x128 group (one Triton kernel), times the e4m3 weight with its 128x128 scales in
    cuBLASLt (fp32 accumulation), in x's dtype. cuBLASLt wants M a multiple of 4: the padding rows are zeros."""
    q, q_scale = quantize_activations_triton(x)
    out = F.scaled_mm(
        q, weight.t(), q_scale, F.ScalingType.BlockWise1x128, scale.t(), F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )  # fmt: skip
    return out[: x.shape[0]]


def quantize_activations_reference(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 [rows, K], fp32 scales [rows, K/128]): each 1x128 group's amax
    maps to 448 (transformers' and DeepSeek's dynamic activation scheme); rows past M (padding) are zeros."""
    m, k = x.shape
    rows = m if rows is None else rows
    groups = F.pad(x.float(), (0, 0, 0, rows - m)).view(rows, k // FP8_BLOCK[1], FP8_BLOCK[1])
    scale = groups.abs().amax(-1).clamp(min=SCALE_FLOOR) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, k), scale


@functools.cache
def _quantize_activations_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M", "M_PAD", "ss_k"])  # ss_k: M_PAD for the prefill layout
    def quantize_activations(
        x_ptr, q_ptr, s_ptr, M, M_PAD, K, sx_m, ss_k, ss_m, FLOOR: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # A program per (row block, 128-column group): its rows' amax, scale and e4m3 values, in one pass. A row's
        # values depend on that row alone (its group's amax; one division per element).
        triton_utils.wait_for_previous_kernel(PDL)
        ms = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        ks = tl.program_id(1) * 128 + tl.arange(0, 128)
        x = tl.load(x_ptr + ms[:, None] * sx_m + ks[None, :], mask=ms[:, None] < M, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR) / 448.0
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
        live = ms < M_PAD
        tl.store(q_ptr + ms[:, None].to(tl.int64) * K + ks[None, :], q.to(q_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(s_ptr + tl.program_id(1) * ss_k + ms * ss_m, scale, mask=live)

    return quantize_activations


def quantize_activations_triton(x: torch.Tensor, block_rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations_reference` with M padded to a multiple of 4, in one launch; the scales come back as
    an M-major [M_PAD, K/128] view (cuBLASLt's layout for 1x128 scales)."""
    import triton

    m, k = x.shape
    rows = -(-m // 4) * 4
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(k // FP8_BLOCK[1], rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_rows), k // FP8_BLOCK[1])
    _quantize_activations_kernel()[grid](  # scales M-major: [K/128, M_PAD] in memory
        x, q, scale, m, rows, k, x.stride(0), rows, 1, FLOOR=SCALE_FLOOR, BLOCK_ROWS=block_rows,
        **triton_utils.launch(x.device),
    )  # fmt: skip
    return q, scale.t()


@functools.cache
def _dequantize_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequantize_fp8_block(
        w_ptr, s_ptr, out_ptr, N, K, ss_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        offsets, mask = ns[:, None].to(tl.int64) * K + ks[None, :], (ns[:, None] < N) & (ks[None, :] < K)
        w = tl.load(w_ptr + offsets, mask=mask, other=0.0)
        dense = triton_utils.fp8_dequantize(
            w, s_ptr, ns, k0, ss_n, N, K, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty, INTERPRETED
        )
        tl.store(out_ptr + offsets, dense, mask=mask)

    return dequantize_fp8_block


def dequantize_triton(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_weight` in one launch (no fp32 temporary)."""
    import triton

    n, k = weight.shape
    assert weight.is_contiguous() and scale.stride(1) == 1
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, 128))
    _dequantize_kernel()[grid](
        weight, scale, out, n, k, scale.stride(0), BLOCK_N=64, BLOCK_K=128, INTERPRETED=INTERPRET,
        **triton_utils.launch(weight.device),
    )  # fmt: skip
    return out


# ---- W8A8 on the decode path (`linear_fp8(..., w8a8=True)`) ---------------------------------------------------

# The invariant (decode, verify, draft) FP8 GEMM on CUDA: "w8a16" (bf16 activations, the weight tile dequantized
# in registers, equal to the bf16 kernel on transformers' dequantized weight) or "w8a8" (activations quantized per
# row and 1x128 group to e4m3, then e4m3 x e4m3 MMAs with both operands from shared memory, each 128-deep block's
# product scaled in fp32: `w8a8_matmul_triton`). Each linear module holds its choice (`fp8_decode`, set from the
# recipe's `model.fp8_decode` by `quant.fp8.set_fp8_decode`). Weights whose K is not a multiple of 128 take
# "w8a16" either way. Packed prefill rows (`prefill_rows`) follow the prefill product instead (`FP8_PREFILL`):
# W8A8 on the "tma" kernel (`prefill_plan_w8a8`) where unpacked prefills run cuBLASLt's W8A8, else W8A16. All are
# batch-invariant, so MTP-on == MTP-off holds with either (`quant.fp8.FP8_DECODE_METHODS`).

# W8A8 plans: `benchmarks/gemm_w8a8.py --family` times the plan family on the GPU; a shape not here takes
# `gemm_plan_w8a8`'s default. 27B: the H200 family run of 2026-12-01 (docs/img/gemm-w8a8-family-27b.json), 64
# weight rows on one warpgroup, 4 tiles of 32 rows: 1.05-1.65x the W8A16 plans at M = 1..32, its quantization
# launch included.
# 16-row tiles since the fourteenth session (docs/img/gemm-w8a8-in-kernel-27b-fourteenth.json, "16-row two
# launches"): 0.80-0.97x the 32-row tiles' time at M = 1..16, the same bits; from 17 rows the 32-row plan is a bucket.
# Deeper pipelines at M <= 16 since the sixteenth session (`gemm_w8a8.py --family --choice-m 1,8,16 --keep-splits`,
# docs/img/gemm-w8a8-family-27b-sixteenth.log): gdn in_proj 25.8/28.0/28.7 -> 25.1/26.2/26.4 us at M = 1/8/16 with
# 8 stages, attn qkv 23.9/26.9/27.7 -> 23.0/23.8/24.2, o_proj 12.9/13.7/14.3 -> 12.5/13.4/14.3 with 6; gate_up kept
# its 4 (8 stages: 54.6 us at M=1); mlp down 29.6/31.3/31.4 -> 27.2/28.7/29.5 with 8 (seventeenth session,
# docs/img/gemm-w8a8-family-mlp-down-seventeenth.json). The same K splits: the same bits.
TUNED_W8A8: dict[tuple[int, int], GemmPlan] = {
    (16384, 5120): GemmPlan(64, 128, 40, 4, 8, "stream", 16, 4, True),  # gdn in_proj qkv+z
    (5120, 6144): GemmPlan(64, 128, 16, 4, 6, "stream", 16, 4, True),  # gdn out_proj / attn o_proj
    (14336, 5120): GemmPlan(64, 128, 40, 4, 8, "stream", 16, 4, True),  # attn qkv
    (34816, 5120): GemmPlan(64, 128, 40, 4, 4, "stream", 16, 4, True),  # mlp gate_up
    (5120, 17408): GemmPlan(64, 128, 46, 4, 8, "stream", 16, 4, True),  # mlp down
}


# Row buckets of the W8A8 kernel, as `ROW_BUCKETS` are of the bf16 one (same rules: `sum_order`, `row_plan`), written
# by `benchmarks/gemm_buckets.py --kind w8a8 --set buckets --apply`, which keeps only tilings measured bitwise equal
# to the shape's plan (H200, 27B FP8 shapes). A shape without an entry runs `gemm_plan_w8a8` at every M.
# BEGIN W8A8_ROW_BUCKETS (written by benchmarks/gemm_buckets.py --apply)
W8A8_ROW_BUCKETS: dict[tuple[int, int], tuple[tuple[int, GemmPlan], ...]] = {
    (5120, 6144): (
        (17, GemmPlan(64, 128, 16, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True)),
        (33, GemmPlan(64, 128, 16, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(64, 128, 16, 4, 4, family="stream", block_m=128, swap_ab=True)),
        (129, GemmPlan(64, 128, 16, 4, 4, family="stream", block_m=128, swap_ab=True)),
    ),
    (5120, 17408): (
        (17, GemmPlan(64, 128, 46, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True)),
        (33, GemmPlan(64, 128, 46, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 128, 46, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 128, 46, 8, 4, family="stream", block_m=128)),
    ),
    (14336, 5120): (
        (17, GemmPlan(64, 128, 40, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True)),
        (33, GemmPlan(64, 128, 40, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=128)),
    ),
    (16384, 5120): (
        (17, GemmPlan(64, 128, 40, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True)),
        (33, GemmPlan(64, 128, 40, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=128)),
    ),
    (34816, 5120): (
        (17, GemmPlan(64, 128, 40, 4, 4, family="stream", block_m=32, row_tiles=4, swap_ab=True)),
        (33, GemmPlan(64, 128, 40, 4, 4, family="stream", block_m=64, swap_ab=True)),
        (65, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=128)),
        (129, GemmPlan(128, 128, 40, 8, 4, family="stream", block_m=128)),
    ),
}
# END W8A8_ROW_BUCKETS

# Row buckets whose tiles load by TMA (`GemmPlan.tma_loads`), per kernel ("bf16", "w8a8") and [N, K]: each bucket by
# its fewest rows (1: the shape's own plan, launches below its first bucket). Written by `benchmarks/
# gemm_tma_loads.py --apply`: a bucket loads by TMA where, at every M measured in it, TMA took at most 1.01x the
# pointer loads' time and 0.97x on average, with the same bits (H200, 27B shapes; docs/img/gemm-tma-loads-27b-
# thirteenth.json). The same bits either way, so this table never changes a result.
# BEGIN TMA_LOAD_BUCKETS (written by benchmarks/gemm_tma_loads.py --apply)
TMA_LOAD_BUCKETS: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {
    "bf16": {
        (5120, 6144): (129,),
        (5120, 10240): (129,),
        (5120, 17408): (129,),
        (14336, 5120): (129,),
        (16480, 5120): (129,),
        (34816, 5120): (129,),
        (248320, 5120): (129,),
    },
    "w8a8": {
        (5120, 6144): (1, 17, 65, 129),
        (5120, 17408): (1, 17, 65, 129),
        (14336, 5120): (65, 129),
        (16384, 5120): (65, 129),
        (34816, 5120): (33, 65, 129),
    },
}
# END TMA_LOAD_BUCKETS


def gemm_plan_w8a8(n: int, k: int) -> GemmPlan:
    """The W8A8 plan for an [N, K] fp8 weight (a function of (N, K) only): tuned, else a "stream" plan with the
    weight block as wgmma's 64-row side (swap_ab: 8 warps on 128 weight rows, or one warpgroup on 64 for narrow
    weights) and 4 tiles of 32 rows per weight pass, its K loop split so that about 160 programs run (at most 4
    splits)."""
    if (n, k) in TUNED_W8A8:
        return TUNED_W8A8[n, k]
    block_n, warps = (128, 8) if n >= 4096 else (64, 4)
    tiles, k_blocks = -(-n // block_n), -(-k // FP8_BLOCK[1])
    splits = max(1, min(4, k_blocks, 160 // tiles))
    return GemmPlan(block_n, FP8_BLOCK[1], -(-k_blocks // splits), warps, 4, "stream", 32, 4, True)


def check_w8a8_plan(plan: GemmPlan) -> None:
    """W8A8 runs the "stream" family (decode) or the "tma" one (prefill rows) with K blocks of exactly one
    activation scale group (128 columns)."""
    if plan.family not in ("stream", "tma") or plan.block_k != FP8_BLOCK[1]:
        raise ValueError(f"a W8A8 plan is a 'stream' or 'tma' plan with block_k {FP8_BLOCK[1]}, got {plan}")


def w8a8_supported(weight: torch.Tensor) -> bool:
    """Whether W8A8 runs this weight: its K a whole number of 1x128 activation groups."""
    return weight.shape[-1] % FP8_BLOCK[1] == 0


# Rows per program and warps of the decode activation quantization by row count: (fewest rows, rows per program,
# warps), by rising bound. Neither choice changes a bit (a row's amax is a max, its division correctly rounded),
# so a launch may take any. H200, 27B shapes (`benchmarks/small_kernels.py`, docs/img/small-kernels-fifteenth.json):
# a program per row and 128-column group takes 1.0-1.2 us at M = 1..4 where 16-row programs took 3.1-3.5 us; from
# 5 rows 4-row programs (1.5-1.8 us at M = 32), from 33 rows 8-row programs (2.2-3.1 us at M = 128).
QUANTIZE_ROWS_PLANS = ((1, 1, 2), (5, 4, 2), (33, 8, 4))


def quantize_rows_plan(m: int) -> tuple[int, int]:
    """(rows per program, warps) of the activation quantization of m rows (`QUANTIZE_ROWS_PLANS`)."""
    return next((block, warps) for fewest, block, warps in reversed(QUANTIZE_ROWS_PLANS) if m >= fewest)


def empty_w8a8_input(like: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised room for `rows` rows of K quantized for the W8A8 product, on `like`'s device: e4m3 [rows, K]
    and fp32 scales [rows, K/128], row-major (`quantize_activation_rows_triton`'s layout, which every op that
    quantizes a W8A8 input in its own launch writes)."""
    q = like.new_empty(rows, k, dtype=torch.float8_e4m3fn)
    return q, like.new_empty(rows, k // FP8_BLOCK[1], dtype=torch.float32)


def quantize_activation_rows_triton(
    x: torch.Tensor, block_rows: int | None = None, warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations_reference` of x [M, K] in one launch (the prefill kernel), unpadded, with the scales
    row-major [M, K/128]: their row stride depends on K alone, so the GEMM that reads them compiles one binary for
    every M. A row's bytes and scales never depend on the other rows. `block_rows` rows per program and `warps`
    (default `quantize_rows_plan(M)`) never change a number."""
    import triton

    x = x.contiguous()
    m, k = x.shape
    q, scale = empty_w8a8_input(x, m, k)
    if m == 0:
        return q, scale
    planned_rows, planned_warps = quantize_rows_plan(m)
    block_rows, warps = block_rows or planned_rows, warps or planned_warps
    grid = (triton.cdiv(m, block_rows), k // FP8_BLOCK[1])
    _quantize_activations_kernel()[grid](
        x, q, scale, m, m, k, x.stride(0), 1, scale.stride(0), FLOOR=SCALE_FLOOR, BLOCK_ROWS=block_rows,
        num_warps=warps, **triton_utils.launch(x.device),
    )  # fmt: skip
    return q, scale


def w8a8_block_products_reference(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, plan: GemmPlan
) -> torch.Tensor:
    """What the W8A8 kernel computes, in fp32 [M, N], in its order: per K split (the plan's), the 128-deep blocks
    from the split's first upwards, acc += (q_blk @ w_blk^T) * (q_scale[row, kb] * scale[n // 128, kb]) (the
    e4m3 products summed in fp32), then the splits' sums added in split order 0, 1, ... (fp32). The kernel adds
    each scaled block with one fused multiply-add; here the product is rounded first: the same bits whenever it
    is exact (power-of-two scales, as the CPU tests use), else within an ulp of the sum per block."""
    n, k = weight.shape
    w_scale = scale.float().repeat_interleave(FP8_BLOCK[0], 0)[:n]  # [N, K/128]
    k_blocks = k // FP8_BLOCK[1]
    total = None
    for first in range(0, k_blocks, plan.k_per_split):
        acc = torch.zeros(q.shape[0], n, dtype=torch.float32, device=q.device)
        for kb in range(first, min(k_blocks, first + plan.k_per_split)):
            cols = slice(kb * FP8_BLOCK[1], (kb + 1) * FP8_BLOCK[1])
            partial = q[:, cols].float() @ weight[:, cols].float().T
            acc = acc + partial * (q_scale[:, kb, None].float() * w_scale[None, :, kb])
        total = acc if total is None else total + acc
    return total


def linear_fp8_w8a8_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, plan: GemmPlan | None = None
) -> torch.Tensor:
    """The W8A8 decode product in plain PyTorch: x [M, K] quantized per row and 1x128 group as the kernel does
    (`quantize_activations_reference`), then `w8a8_block_products_reference` with the shape's plan, in x's
    dtype."""
    q, q_scale = quantize_activations_reference(x)
    plan = plan or gemm_plan_w8a8(*weight.shape)
    return w8a8_block_products_reference(q, q_scale, weight, scale, plan).to(x.dtype)


@functools.cache
def _w8a8_kernel():
    """The "stream" family on e4m3 activations (`_stream_kernel` for the structure and why a row never depends on
    M): each weight block [BLOCK_N, 128] is loaded once per row group and goes from shared memory straight into
    the MMA of every row tile, as do the rows' e4m3 blocks (both K-major, as an fp8 wgmma needs). Each block's
    product starts from zero and is scaled in fp32 by its rows' and weight block's scales as it joins the
    accumulator: the MMA's own (reduced-precision on Hopper) accumulation spans 128 columns only. That join is an
    explicit fused multiply-add (one rounding), so no compiler contraction choice can differ between the loops
    compiled for different live tile counts."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one binary whatever the row count
    def matmul_w8a8(
        q_ptr, qs_ptr, w_ptr, wp_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
        sq_m, sqs_m, sw_n, ss_n, so_m, k_per_split,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        ROW_TILES: tl.constexpr, SWAP_AB: tl.constexpr, INTERPRETED: tl.constexpr, L2_PREFETCH_K: tl.constexpr = 0,
        L2_PREFETCH_BYTES: tl.constexpr = 0, TMA: tl.constexpr = False, PDL: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.prefetch_weight_rows(wp_ptr, tl.program_id(0) * BLOCK_N, tl.program_id(1) * k_per_split * BLOCK_K,
                                          N, K, sw_n, BLOCK_N, L2_PREFETCH_K, L2_PREFETCH_BYTES)  # fmt: skip
        # TMA: q_ptr and w_ptr are tensor descriptors of [BLOCK_M, 128] and [BLOCK_N, 128] e4m3 blocks
        # (`GemmPlan.tma_loads`): the same blocks, copied by the tensor memory accelerator; wp_ptr is the weight's
        # address either way (the prefetch's).
        triton_utils.wait_for_previous_kernel(PDL)
        pid_n, split = tl.program_id(0), tl.program_id(1)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows, ks = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K)
        k_start = split * k_per_split * BLOCK_K
        k_end = tl.minimum(K, k_start + k_per_split * BLOCK_K)
        plane = M.to(tl.int64) * N
        part = part_ptr + split * plane
        if not TMA:
            w_rows = w_ptr + ns[:, None].to(tl.int64) * sw_n + ks[None, :]
        for row0 in range(0, M, ROW_TILES * BLOCK_M):
            live = tl.minimum(tl.cdiv(M - row0, BLOCK_M), ROW_TILES)
            for tiles in tl.static_range(1, ROW_TILES + 1):
                if live == tiles:
                    acc0 = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
                    accs = (acc0,) * tiles
                    for k0 in range(k_start, k_end, BLOCK_K):
                        kb = k0 // BLOCK_K
                        if TMA:
                            w = w_ptr.load([pid_n * BLOCK_N, k0])
                        else:
                            w = tl.load(w_rows + k0, mask=ns[:, None] < N, other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
                        w_scale = tl.load(s_ptr + (ns // 128) * ss_n + kb, mask=ns < N, other=0.0)
                        updated = ()
                        for t in tl.static_range(tiles):
                            ms = row0 + t * BLOCK_M + rows
                            if TMA:
                                x = q_ptr.load([row0 + t * BLOCK_M, k0])
                            else:
                                x = tl.load(
                                    q_ptr + ms[:, None].to(tl.int64) * sq_m + (k0 + ks)[None, :],
                                    mask=ms[:, None] < M, other=0.0,
                                )  # fmt: skip
                            x_scale = tl.load(qs_ptr + ms * sqs_m + kb, mask=ms < M, other=0.0)
                            if SWAP_AB:
                                prod = triton_utils.dot(w, tl.trans(x), INTERPRETED, "ieee")  # [BLOCK_N, BLOCK_M]
                                factor = w_scale[:, None] * x_scale[None, :]
                            else:
                                prod = triton_utils.dot(x, tl.trans(w), INTERPRETED, "ieee")  # [BLOCK_M, BLOCK_N]
                                factor = x_scale[:, None] * w_scale[None, :]
                            updated = updated + (tl.fma(prod, factor, accs[t]),)
                        accs = updated
                    for t in tl.static_range(tiles):
                        acc = tl.trans(accs[t]) if SWAP_AB else accs[t]  # [BLOCK_M, BLOCK_N]
                        ms = (row0 + t * BLOCK_M + rows).to(tl.int64)
                        mask = (ms[:, None] < M) & (ns[None, :] < N)
                        if SPLITS == 1:
                            out = acc.to(out_ptr.dtype.element_ty)
                            tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], out, mask=mask)
                        else:
                            tl.store(part + ms[:, None] * N + ns[None, :], acc, mask=mask)
            if SPLITS > 1:
                # The split partials of this row group, added in split order by the last split to finish them.
                tl.debug_barrier()
                counter = count_ptr + pid_n * tl.cdiv(M, ROW_TILES * BLOCK_M) + row0 // (ROW_TILES * BLOCK_M)
                if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                    for r0 in range(row0, tl.minimum(M, row0 + ROW_TILES * BLOCK_M), BLOCK_M):
                        ms = (r0 + rows).to(tl.int64)
                        mask = (ms[:, None] < M) & (ns[None, :] < N)
                        tile = ms[:, None] * N + ns[None, :]
                        total = tl.load(part_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
                        for s in range(1, SPLITS):
                            total += tl.load(part_ptr + s * plane + tile, mask=mask, other=0.0, cache_modifier=".cg")
                        out = total.to(out_ptr.dtype.element_ty)
                        tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], out, mask=mask)
                    tl.atomic_xchg(counter, 0, sem="relaxed")

    return matmul_w8a8


def w8a8_matmul_triton(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    plan: GemmPlan | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """e4m3 rows q [M, K] with their 1x128 scales q_scale [M, K/128] (row-major) times the e4m3 weight [N, K] with
    its 128x128 scales -> [M, N] in `out_dtype`, by the plan (default: the shape's `row_plan` for M rows among
    `W8A8_ROW_BUCKETS` and `gemm_plan_w8a8`): equal to
    `w8a8_block_products_reference` up to the MMA's accumulation within a block and the fused scaling (see
    there), and a row's result never depends on M."""
    import triton

    m, k = q.shape
    n = weight.shape[0]
    assert q.dtype == weight.dtype == torch.float8_e4m3fn and q.stride(1) == 1 and weight.stride(1) == 1
    assert k % FP8_BLOCK[1] == 0 and tuple(q_scale.shape) == (m, k // FP8_BLOCK[1]) and q_scale.stride(1) == 1
    assert tuple(scale.shape) == (-(-n // FP8_BLOCK[0]), k // FP8_BLOCK[1]) and scale.stride(1) == 1, "scale grid"
    if plan is None:
        hopper = INTERPRET or _is_hopper(q.device)
        plan = row_plan(n, k, m, hopper, W8A8_ROW_BUCKETS, gemm_plan_w8a8, TMA_LOAD_BUCKETS["w8a8"])
    check_w8a8_plan(plan)
    splits = plan.splits(k)
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    if plan.family == "tma":  # prefill rows (`prefill_plan_w8a8`)
        _tma_matmul(q, weight, out, plan, q_scale, scale)
        return out
    n_tiles = triton.cdiv(n, plan.block_n)
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=q.device)
    counters = out
    if splits > 1:
        counters = _tile_counters(q.device, n_tiles * triton.cdiv(m, plan.row_tiles * plan.block_m))
    tma = plan.tma_loads and tma_available(q.device)  # e4m3 rows of K % 128 == 0 bytes: always 16-byte multiples
    q_tiles, w_tiles = (tma and _tile_descriptors(q, weight, plan)) or (q, weight)
    options = triton_utils.launch(q.device)
    options |= l2_prefetch_columns(plan, weight, options["PDL"])
    row_tiles = launch_row_tiles(plan, m)
    _w8a8_kernel()[(n_tiles, splits)](
        q_tiles, q_scale, w_tiles, weight, scale, out, part, counters, m, n, k,
        q.stride(0), q_scale.stride(0), weight.stride(0), scale.stride(0), out.stride(0), plan.k_per_split,
        SPLITS=splits, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, ROW_TILES=row_tiles,
        SWAP_AB=plan.swap_ab, INTERPRETED=INTERPRET, TMA=q_tiles is not q, num_warps=plan.num_warps,
        num_stages=plan.num_stages, **options,
    )  # fmt: skip
    return out


def linear_fp8_w8a8_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, plan: GemmPlan | None = None
) -> torch.Tensor:
    """The W8A8 decode product of x [M, K]: two launches, the activation quantization
    (`quantize_activation_rows_triton`) and `w8a8_matmul_triton`, in x's dtype."""
    q, q_scale = quantize_activation_rows_triton(x)
    return w8a8_matmul_triton(q, q_scale, weight, scale, plan, x.dtype)


def check_tma_load_buckets(loads: dict, buckets: dict) -> None:
    """Every row bucket `TMA_LOAD_BUCKETS` names for a kernel exists in its table (1: the shape's own plan)."""
    for (n, k), starts in loads.items():
        known = {1, *(fewest for fewest, _ in buckets.get((n, k), ()))}
        if not set(starts) <= known:
            raise ValueError(f"TMA loads of {n}x{k}: row buckets {sorted(set(starts) - known)} are not in its table")


check_row_buckets(ROW_BUCKETS)
check_row_buckets(W8A8_ROW_BUCKETS, gemm_plan_w8a8)
check_row_buckets(PREFILL_ROW_BUCKETS, prefill_gemm_plan)
check_tma_load_buckets(TMA_LOAD_BUCKETS["bf16"], ROW_BUCKETS)
check_tma_load_buckets(TMA_LOAD_BUCKETS["w8a8"], W8A8_ROW_BUCKETS)
for _plan in (plan for entries in W8A8_ROW_BUCKETS.values() for _, plan in entries):
    check_w8a8_plan(_plan)
