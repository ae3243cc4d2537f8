"""SwiGLU on a fused [gate | up] projection: `silu(gate) * up` in one launch instead of two.

The MLP's gate and up projections run as one GEMM on CUDA (`MLP.gate_up_proj`, a `MergedLinear`); this op
reads both halves of its output in place (no split copies). Rounding follows the two eager ops (silu rounded to
the activation dtype, then the product), so it only saves launches. The kernel is elementwise, hence
batch-invariant by construction; the CPU reference is with `invariant` (see `swiglu_reference`).
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import elementwise, triton_utils
from qwen_mtp.ops.backend import reference_forced


def swiglu_reference(gate_up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate) * up [..., I].

    silu runs on a contiguous copy of the gate, as HF's MLP runs it on its own projection's output: torch's CPU
    silu rounds the elements its vector loop leaves over differently, and over strided rows of I that is the
    last I % 32 of every row (the shared experts' width, e.g. 48, showed it). Over the contiguous copy that is
    the tail of the whole tensor, which moves with the batch: `invariant` (decode, verify) rounds every element
    the same way instead (`ops/elementwise.py`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return elementwise.silu(gate.contiguous(), invariant) * up


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _swiglu_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_rows(gu_ptr, out_ptr, INTER, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        gate = tl.load(gu_ptr + row * 2 * INTER + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        silu = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * INTER + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)

    return swiglu_rows


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    import triton

    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter).contiguous()
    out = rows.new_empty(rows.shape[0], inter)
    block = 1024
    launch = triton_utils.launch(rows.device)
    _swiglu_kernel()[(rows.shape[0], triton.cdiv(inter, block))](rows, out, inter, BLOCK=block, **launch)
    return out.reshape(*gate_up.shape[:-1], inter)


@torch.library.custom_op("qwen_mtp::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Custom op: `swiglu_reference` on CPU, the Triton kernel on CUDA (elementwise per program: invariant)."""
    return swiglu_reference(gate_up, invariant).contiguous()


@swiglu.register_kernel("cuda")
def _(gate_up, invariant=False):
    if reference_forced("swiglu"):
        return swiglu_reference(gate_up, invariant).contiguous()
    return swiglu_triton(gate_up)


@swiglu.register_fake
def _(gate_up, invariant=False):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)

register_reference_autograd(swiglu, swiglu_reference)
