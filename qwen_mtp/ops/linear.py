"""The linear op `qwen_mtp::linear(x, weight, invariant)`: every projection of the model goes through it.

`invariant=False` is the device's fastest GEMM (`F.linear`: cuBLAS on CUDA, and on CPU exactly what Hugging
Face computes). `invariant=True` is what the decode, verify and draft steps ask for: a row's result must not
depend on the other rows. A GEMM library picks its kernel by the number of rows: on CPU, fp32 `F.linear` over
1 row and over 8 rows round differently (measured: ~1000 of 1000-odd row comparisons differ in the last bit);
cuBLAS likewise picks kernels (and split-K) by M. Greedy decoding must give a request the same tokens whatever
else shares its batch, so on that path every row's reduction order must not depend on the row count:
- CPU (and CUDA with `ops.backend.reference_ops()`): every row is its own 1-row product, `bmm` over
  [rows, 1, K] x [rows, K, N] (weight broadcast, not copied);
- CUDA: our Triton GEMM. Its tiles and its split of the K loop are a function of (N, K) only, and the split
  partial sums are added in one fixed order (never accumulated with atomics), so a row's result is the same
  for M = 1 and M = 160. Splitting K keeps the GPU busy on shapes with few output tiles (tall K like `down_proj`,
  tiny N like `in_proj_a`), where one program per tile would leave most SMs idle.
It is a custom op so `torch.compile` keeps it opaque and CUDA graphs capture it; backward is the plain GEMM
gradient, so training runs the same module code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qwen_mtp.ops import triton_utils
from qwen_mtp.ops.backend import reference_forced
from qwen_mtp.ops.triton_utils import INTERPRET

BLOCK_M = 16  # rows per program: tl.dot's minimum; never depends on M
TARGET_PROGRAMS = 320  # programs in flight for an untuned shape: ~2-3 per SM on a 132-SM H200


@dataclass(frozen=True)
class GemmPlan:
    """How one [N, K] weight is tiled: a function of the weight's shape only, never of M (batch invariance)."""

    block_n: int
    block_k: int
    k_per_split: int  # K blocks per split: the K loop is cut into ceil(K blocks / k_per_split) splits
    num_warps: int = 4
    num_stages: int = 3

    def splits(self, k: int) -> int:
        k_blocks = -(-k // self.block_k)
        return -(-k_blocks // self.k_per_split)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear` with each row of x reduced on its own: the result of a row never depends on the others."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, 1, in_features)
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.shape[0], in_features, out_features))
    return out.reshape(*x.shape[:-1], out_features)


# Measured on the H200 (benchmarks/gemm_sweep.py, 2026-11-29): the fastest batch-invariant plan per
# Qwen3.5-27B decode shape at M = 1 and 8 (e.g. in_proj_a/b 6.5 us vs 34.9 us for the default plan).
TUNED: dict[tuple[int, int], GemmPlan] = {
    (16480, 5120): GemmPlan(64, 128, 40, 4, 4),  # gdn in_proj qkv/z/b/a (fused)
    (5120, 6144): GemmPlan(32, 128, 16, 4, 3),  # gdn out_proj, attn o_proj
    (14336, 5120): GemmPlan(64, 128, 40, 4, 4),  # attn q (+ gate)/k/v (fused)
    (34816, 5120): GemmPlan(32, 256, 20, 4, 4),  # mlp gate_up (fused)
    (5120, 17408): GemmPlan(64, 128, 34, 4, 3),  # mlp down_proj
    (5120, 10240): GemmPlan(64, 128, 20, 4, 3),  # mtp fc
}


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


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _matmul_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one binary whatever the row count
    def kernel(
        x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
        sx_m, sw_n, so_m, k_per_split,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Row tiles of one weight tile are neighbours in launch order, so a weight tile read from HBM serves
        # every row tile from L2.
        pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start = split * k_per_split * BLOCK_K
        k_end = tl.minimum(K, k_start + k_per_split * BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
            kmask = (k0 + ks) < k_end
            x = tl.load(
                x_ptr + ms[:, None] * sx_m + (k0 + ks)[None, :], mask=(ms[:, None] < M) & kmask[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + ns[:, None] * sw_n + (k0 + ks)[None, :], mask=(ns[:, None] < N) & kmask[None, :], other=0.0
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

    return kernel


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: zeroed split counters, re-armed by the kernel


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        # Allocated once (before any graph capture, in the warm-up run) at a fixed address.
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
    return counters


def invariant_matmul_triton(x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T with a fixed, M-independent reduction order (fp32 accumulation)."""
    import triton

    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    assert weight.stride(1) == 1
    plan = plan or gemm_plan(n, k)
    splits = plan.splits(k)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, plan.block_n), splits)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    counters = _tile_counters(x.device, grid[0] * grid[1]) if splits > 1 else out
    _matmul_kernel()[grid](
        x, weight, out, part, counters, m, n, k, x.stride(0), weight.stride(0), out.stride(0), plan.k_per_split,
        SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        INTERPRETED=INTERPRET, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps, num_stages=plan.num_stages,
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


@linear_op.register_kernel("cuda")
def _(x, weight, invariant):
    if not invariant:
        return F.linear(x, weight).contiguous()
    if reference_forced("linear"):
        return rowwise_linear(x, weight)
    return invariant_matmul_triton(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])


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
