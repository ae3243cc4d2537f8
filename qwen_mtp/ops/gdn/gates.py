"""The GDN gates of a packed step (several sequences back to back), as the op `qwen_mtp::gate_values_varlen`.

`naive.gate_values` is elementwise, but on CPU torch rounds an element of a vector loop and one of its scalar tail
differently (`ops/elementwise.py`), so a sequence's gates computed inside a packed tensor could differ from the
same sequence alone: CPU runs them per sequence. CUDA's elementwise kernels compute every element with the same
code wherever it sits, so there one call covers all the sequences, instead of a few launches per sequence and
layer (32 sequences x 48 GDN layers at 27B).
"""

from __future__ import annotations

import torch

from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.gdn.naive import gate_values


def gate_values_varlen_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,  # noqa: N803
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [1, N, Hv]: S sequences back to back (bounds cu_seqlens [S + 1]). `gate_values` on each sequence:
    (g [1, N, Hv] fp32, beta [1, N, Hv] in b's dtype)."""
    bounds = cu_seqlens.tolist()
    parts = [gate_values(a[:, i:j], b[:, i:j], A_log, dt_bias) for i, j in zip(bounds[:-1], bounds[1:], strict=True)]
    return tuple(torch.cat(gates, dim=1) for gates in zip(*parts, strict=True))


@torch.library.custom_op("qwen_mtp::gate_values_varlen", mutates_args=())
def gate_values_varlen(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,  # noqa: N803
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op: `gate_values_varlen_reference` on CPU; `gate_values` over all the sequences at once on CUDA."""
    return gate_values_varlen_reference(a, b, A_log, dt_bias, cu_seqlens)


def gate_values_at_once(a, b, A_log, dt_bias):  # noqa: N803
    """CUDA: `gate_values` over the packed tensor (every element computed as alone; the module docstring)."""
    g, beta = gate_values(a, b, A_log, dt_bias)
    return g.contiguous(), beta.contiguous()


@cuda_kernel(gate_values_varlen)
def _(a, b, A_log, dt_bias, cu_seqlens):  # noqa: N803
    if reference_forced("gate_values_varlen"):
        return gate_values_varlen_reference(a, b, A_log, dt_bias, cu_seqlens)
    return gate_values_at_once(a, b, A_log, dt_bias)


@gate_values_varlen.register_fake
def _(a, b, A_log, dt_bias, cu_seqlens):  # noqa: N803
    return a.new_empty(a.shape, dtype=torch.float32), b.new_empty(b.shape)
