"""Batch-invariant linear layers for the decode, verify and draft path.

A GEMM library picks its kernel by the number of rows: on CPU, fp32 `F.linear` over 1 row and over 8 rows
round differently (measured: ~1000 of 1000-odd row comparisons differ in the last bit); cuBLAS likewise picks
kernels (and split-K) by M. Greedy decoding must give a request the same tokens whatever else shares its
batch, so on that path every row's reduction order must not depend on the row count:
- CPU: every row is its own 1-row product, `bmm` over [rows, 1, K] x [rows, K, N] (weight broadcast, not
  copied);
- CUDA: our Triton GEMM, whose tile sizes are a function of (N, K) only and whose K loop runs in one fixed
  order with no split-K, so a row's result is the same for M = 1 and M = 160.
The engine enters `batch_invariant_linears()` around those steps; the model keeps plain `nn.Linear` modules.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from qwen_mtp.ops.triton_utils import INTERPRET


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with each row of x reduced on its own: the result of a row never depends on the others."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, 1, in_features)
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.shape[0], in_features, out_features))
    out = out.reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _matmul_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one binary whatever the row count
    def kernel(
        x_ptr, w_ptr, out_ptr, M, N, K,
        sx_m, sw_n, so_m,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + ks) < K
            x = tl.load(
                x_ptr + ms[:, None] * sx_m + (k0 + ks)[None, :], mask=(ms[:, None] < M) & kmask[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + ns[:, None] * sw_n + (k0 + ks)[None, :], mask=(ns[:, None] < N) & kmask[None, :], other=0.0
            )
            if UPCAST:  # the CPU interpreter's tl.dot is wrong on 16-bit inputs
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        tl.store(
            out_ptr + ms[:, None] * so_m + ns[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(ms[:, None] < M) & (ns[None, :] < N),
        )

    return kernel


def invariant_matmul_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T with a fixed, M-independent reduction order (fp32 accumulation)."""
    import triton

    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    assert weight.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = 16, 32 if n >= 4096 else 16, 128  # (N, K)-dependent only, never M
    _matmul_kernel()[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=INTERPRET, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The batch-invariant `F.linear` of this device: Triton GEMM on CUDA, row-wise `bmm` elsewhere."""
    if not x.is_cuda:
        return rowwise_linear(x, weight, bias)
    out = invariant_matmul_triton(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class batch_invariant_linears(TorchFunctionMode):  # noqa: N801 - used as a context manager, like no_grad
    """Inside this context every `F.linear` (so every `nn.Linear`) is computed by `invariant_linear`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs)
        return func(*args, **kwargs)
