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
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.linear import empty_w8a8_input, quantize_activations_reference
from qwen_mtp.quant.fp8 import FP8_BLOCK, SCALE_FLOOR


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
    def swiglu_rows(
        gu_ptr, out_ptr, q_ptr, qs_ptr, INTER, BLOCK: tl.constexpr, QUANT: tl.constexpr = False,
        FLOOR: tl.constexpr = 0.0, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # QUANT: the output is also quantized for the W8A8 product it feeds (q_ptr [rows, INTER] e4m3, qs_ptr
        # [rows, INTER / 128] fp32; BLOCK a multiple of 128).
        triton_utils.wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        first = tl.program_id(1) * BLOCK
        cols = first + tl.arange(0, BLOCK)
        mask = cols < INTER
        gate = tl.load(gu_ptr + row * 2 * INTER + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        silu = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
        y = (silu * up).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * INTER + cols, y, mask=mask)
        if QUANT:
            q_row, qs_row = q_ptr + row * INTER, qs_ptr + row * (INTER // 128)
            triton_utils.store_e4m3_groups(y.to(tl.float32), q_row, qs_row, first, INTER, BLOCK // 128, FLOOR)

    return swiglu_rows


def swiglu_triton(gate_up: torch.Tensor, quantize: bool = False):
    """Triton version of `swiglu_reference`; `quantize`: (out, e4m3 [rows, I], fp32 scales [rows, I / 128]), the
    output and its W8A8 activation quantization (I a multiple of 128), as `quantize_activation_rows_triton`
    gives it."""
    import triton

    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter).contiguous()
    out = rows.new_empty(rows.shape[0], inter)
    if quantize and inter % FP8_BLOCK[1]:
        raise ValueError(f"swiglu_triton(quantize=True) needs a width of a multiple of {FP8_BLOCK[1]}, got {inter}")
    q, q_scale = empty_w8a8_input(rows, *out.shape) if quantize else (out, out)
    block = 1024
    _swiglu_kernel()[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, q, q_scale, inter, BLOCK=block, QUANT=quantize, FLOOR=SCALE_FLOOR,
        **triton_utils.launch(rows.device),
    )  # fmt: skip
    out = out.reshape(*gate_up.shape[:-1], inter)
    return (out, q, q_scale) if quantize else out


@torch.library.custom_op("qwen_mtp::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Custom op: `swiglu_reference` on CPU, the Triton kernel on CUDA (elementwise per program: invariant)."""
    return swiglu_reference(gate_up, invariant).contiguous()


@cuda_kernel(swiglu)
def _(gate_up, invariant=False):
    if reference_forced("swiglu"):
        return swiglu_reference(gate_up, invariant).contiguous()
    return swiglu_triton(gate_up)


@swiglu.register_fake
def _(gate_up, invariant=False):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def swiglu_w8a8_reference(gate_up: torch.Tensor, invariant: bool = False) -> tuple[torch.Tensor, ...]:
    """(out, q, q_scale): `swiglu_reference`, then its rows' W8A8 quantization (`quantize_activations_reference`)."""
    out = swiglu_reference(gate_up, invariant).contiguous()
    return out, *quantize_activations_reference(out.reshape(-1, out.shape[-1]))


@torch.library.custom_op("qwen_mtp::swiglu_w8a8", mutates_args=())
def swiglu_w8a8(gate_up: torch.Tensor, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Custom op: SwiGLU that also quantizes its output for the W8A8 down projection (`swiglu_w8a8_reference`),
    the bytes that product's own quantization launch would write (`qwen_mtp::norm_w8a8` says why). On CUDA one
    launch, on CPU the reference."""
    return swiglu_w8a8_reference(gate_up, invariant)


@cuda_kernel(swiglu_w8a8)
def _(gate_up, invariant=False):
    if reference_forced("swiglu_w8a8"):
        return swiglu_w8a8_reference(gate_up, invariant)
    return swiglu_triton(gate_up, quantize=True)


@swiglu_w8a8.register_fake
def _(gate_up, invariant=False):
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    return gate_up.new_empty(*gate_up.shape[:-1], inter), *empty_w8a8_input(gate_up, rows, inter)


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)

register_reference_autograd(swiglu, swiglu_reference)
