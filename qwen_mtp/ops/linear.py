"""Batch-invariant linear layers for the decode (and later verify / draft) path.

A GEMM library picks its kernel by the number of rows: on CPU, fp32 `F.linear` over 1 row and over 8 rows
round differently (measured: ~1000 of 1000-odd row comparisons differ in the last bit). Greedy decoding
must give a request the same tokens whatever else shares its batch, so on that path every row is computed as
its own 1-row product: `bmm` over [rows, 1, K] x [rows, K, N] (the weight broadcast, not copied) fixes each
row's reduction order independently of the row count. The engine enters `batch_invariant_linears()` around
decode steps; the model keeps plain `nn.Linear` modules. (GPU kernels with the same property come later.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` with each row of x reduced on its own: the result of a row never depends on the others."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, 1, in_features)
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.shape[0], in_features, out_features))
    out = out.reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias


class batch_invariant_linears(TorchFunctionMode):  # noqa: N801 - used as a context manager, like no_grad
    """Inside this context every `F.linear` (so every `nn.Linear`) is computed by `rowwise_linear`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return rowwise_linear(*args, **kwargs)
        return func(*args, **kwargs)
