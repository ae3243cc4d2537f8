"""`qwen_mtp::prefetch_weight`: ask L2 for a weight that a later product of the same step will read, while the short
launches before that product leave HBM idle.

Why: between a layer's input and output projections run only short, latency-bound launches. In a GDN layer: the
b/a projection, the conv update, the delta rule and the gated norm; in an attention layer: q/k norm and rope, the
KV write, the split-KV attention and the output gate. At a few rows they take ~13-20 us together and stream almost
nothing from HBM, then the output projection streams its whole weight (27B: 5120 x 6144, 31.5 MB in FP8, 63 MB in
bf16). Launched just after the input projection, this op asks L2 for the output projection's weight in that window,
so the product finds it there instead of in HBM.

What it asks for: for every weight row and every K split of the product's plan (`linear.decode_split_columns`; a
program of the product walks one split's K blocks in order), the split's first `columns` columns, one bulk L2
prefetch each (`cp.async.bulk.prefetch.L2.global`: no register or shared memory holds the bytes, nothing waits for
them). A weight that fits the budget (`WINDOW_PREFETCH_MIB`) is asked for whole; a larger one for the same leading
share of every split, so every program of the product finds the start of its walk in L2.

Why it cannot change a number: it reads nothing into a register and writes nothing (weights are never written
during a step). Its kernel waits for the kernel before it (the input projection, whose own streaming would evict
the bytes otherwise) and then lets the next one launch, so it costs the chain about one launch.

Where it runs: only while a CUDA graph is captured (the decode, verify and draft steps; an eager launch costs ~12
us of host time, more than it saves), on Hopper (the instruction is sm_90's), for launches of at most
`WINDOW_PREFETCH_ROWS` rows: at more rows the window's own traffic (each row's recurrent state, 3 MB a GDN layer at
27B) streams through L2 and would evict the bytes before the product reads them. Elsewhere, and under the CPU
reference, it does nothing.

Placement: the op returns nothing, so a compiler would drop it as dead code and would be free to move it anywhere;
it is registered as having a side effect (`torch.fx.node.has_side_effect`: kept), and it takes the input
projection's output (`after`) so that it is scheduled once that output exists: inductor places an op with no
other constraint right after its last input (tests/ops/test_weight_prefetch.py checks both in a compiled graph).
"""

from __future__ import annotations

import functools
import os

import torch
from torch.fx.node import has_side_effect

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced

# The bytes of a weight asked for in one window, in MiB: 32 takes the 27B's FP8 output projections whole (30 MiB)
# and the first half of each K split of their bf16 (60 MiB); 0 (the default until measured): the op does nothing.
# QWEN_MTP_WINDOW_PREFETCH=N sets it for the engine-wide A/B (`benchmarks/gpu_suite.sh` STAGE=prefetch, "env:").
WINDOW_PREFETCH_MIB = float(os.environ.get("QWEN_MTP_WINDOW_PREFETCH", "0"))
# The most rows a launch may have for the op to ask (its `after` tensor's rows, all dims but the last); above it,
# nothing (module docstring). QWEN_MTP_WINDOW_PREFETCH_ROWS=N sets it for the A/B.
WINDOW_PREFETCH_ROWS = int(os.environ.get("QWEN_MTP_WINDOW_PREFETCH_ROWS", "4"))
ROWS_PER_PROGRAM = 64  # weight rows a program asks for (x the K splits: one bulk prefetch each)


def k_splits(k: int, split_columns: int) -> tuple[int, int]:
    """(columns of a K split, K splits) of a K-column weight cut every `split_columns` columns (one split if wider)."""
    split_columns = min(split_columns, k)
    return split_columns, -(-k // split_columns)


def prefetch_columns(weight: torch.Tensor, split_columns: int, budget_bytes: float) -> int:
    """The leading columns of every K split (of `split_columns` columns) to ask for, so that all rows x splits stay
    within `budget_bytes` (the whole split where they fit), or 0 where the bulk prefetch cannot take them: its
    addresses and sizes must be 16-byte multiples (the weight's start, row stride, row, split and the count)."""
    n, k = weight.shape
    size = weight.element_size()
    split_columns, splits = k_splits(k, split_columns)
    aligned = (
        weight.stride(1) == 1
        and weight.data_ptr() % 16 == 0
        and all(count * size % 16 == 0 for count in (weight.stride(0), k, split_columns))
    )
    if not aligned or budget_bytes <= 0 or n == 0:
        return 0
    per_row_split = int(budget_bytes // (n * splits * size))  # columns within the budget
    columns = min(split_columns, per_row_split)
    step = 16 // size  # columns of 16 bytes (element sizes divide 16)
    return columns // step * step


def prefetch_weight_reference(weight: torch.Tensor, after: torch.Tensor, split_columns: int) -> None:
    """What the op computes: nothing (a cache hint has no value to compute)."""
    return None


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _prefetch_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_weight_splits(
        w_ptr, N, sw_n, K: tl.constexpr, SPLIT_COLUMNS: tl.constexpr, SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr, COLUMNS: tl.constexpr, ELEMENT_BYTES: tl.constexpr, ROWS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # A program: ROWS weight rows x every K split, the split's first COLUMNS columns (fewer in a last, shorter
        # split), one bulk L2 prefetch each, predicated off past N rows and SPLITS splits. After the wait: the
        # kernel before it streams its own weight through L2, which would evict these bytes.
        triton_utils.wait_for_previous_kernel(PDL)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        splits = tl.arange(0, SPLITS_P2)
        starts = splits * SPLIT_COLUMNS
        sizes = (tl.minimum(COLUMNS, K - starts) * ELEMENT_BYTES).to(tl.int32)
        addresses = w_ptr + rows.to(tl.int64)[:, None] * sw_n + starts[None, :]
        live = ((rows < N)[:, None] & (splits < SPLITS)[None, :]).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t}"
            "\n\tmov.u32 $0, 0;", "=r,l,r,r",
            [addresses, tl.broadcast_to(sizes[None, :], (ROWS, SPLITS_P2)), live], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip

    return prefetch_weight_splits


def prefetch_weight_triton(weight: torch.Tensor, split_columns: int, columns: int) -> None:
    """Launch the prefetch of `columns` leading columns of every `split_columns`-column K split of every row (the
    host checked the 16-byte rules: `prefetch_columns`)."""
    import triton

    n, k = weight.shape
    split_columns, splits = k_splits(k, split_columns)
    _prefetch_kernel()[(triton.cdiv(n, ROWS_PER_PROGRAM),)](
        weight, n, weight.stride(0), K=k, SPLIT_COLUMNS=split_columns, SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), COLUMNS=columns, ELEMENT_BYTES=weight.element_size(),
        ROWS=ROWS_PER_PROGRAM, **triton_utils.launch(weight.device),
    )  # fmt: skip


def window_prefetch_columns(weight: torch.Tensor, after: torch.Tensor, split_columns: int) -> int:
    """The columns a launch asks for now (0: no launch): inside a CUDA graph capture on Hopper, `after` of at most
    `WINDOW_PREFETCH_ROWS` rows, the 16-byte rules met (`prefetch_columns`)."""
    rows = after.numel() // after.shape[-1] if after.dim() and after.shape[-1] else 0
    if not (
        weight.is_cuda
        and not triton_utils.INTERPRET
        and 0 < rows <= WINDOW_PREFETCH_ROWS
        and torch.cuda.is_current_stream_capturing()
        and triton_utils.hopper_or_later(weight.device)
    ):
        return 0
    return prefetch_columns(weight, split_columns, WINDOW_PREFETCH_MIB * 2**20)


@torch.library.custom_op("qwen_mtp::prefetch_weight", mutates_args=())
def prefetch_weight(weight: torch.Tensor, after: torch.Tensor, split_columns: int) -> None:
    """Custom op: ask L2 for `weight` [N, K] (a product's, in K splits of `split_columns` columns) once `after`
    exists (the module docstring). Nothing on CPU or under the reference; one launch on CUDA where it can help."""
    return prefetch_weight_reference(weight, after, split_columns)


@cuda_kernel(prefetch_weight)
def _(weight, after, split_columns):
    if reference_forced("prefetch_weight"):
        return None
    columns = window_prefetch_columns(weight, after, split_columns)
    if columns:
        prefetch_weight_triton(weight, split_columns, columns)
    return None


@prefetch_weight.register_fake
def _(weight, after, split_columns):
    return None


has_side_effect(torch.ops.qwen_mtp.prefetch_weight.default)  # returns nothing, yet must stay (module docstring)
