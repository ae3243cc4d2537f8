"""The gated attention's output gate, `out * sigmoid(gate)`, in one launch, reading both operands in place.

Qwen3.5's attention gates each head's output with a sigmoid of its own projection (the second half of each q_proj
head). In torch that is a transpose, a sigmoid over a strided copy (`elementwise.sigmoid`, invariant on the decode
path), a product and a reshape into o_proj's input: three to four launches at decode sizes, every attention layer,
every step. The kernel reads the attention output [B, T, H, D] and the gate where they lie, rounds as the torch ops
do (the sigmoid to the activation dtype, then the product), and writes o_proj's input [B, T, H * D]. On the
decode path it may also quantize that input for a W8A8 o_proj (`output_gate_w8a8`), one launch fewer again.
A program per (token, head) reads only that token's values: batch-invariant by construction.
"""

from __future__ import annotations

import functools

import torch

from qwen_mtp.ops import elementwise, triton_utils
from qwen_mtp.ops.backend import cuda_kernel, reference_forced
from qwen_mtp.ops.linear import empty_w8a8_input, quantize_activations_reference
from qwen_mtp.quant.fp8 import FP8_BLOCK, SCALE_FLOOR


def output_gate_reference(out: torch.Tensor, gate: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """out, gate [B, T, H, D] -> out * sigmoid(gate) as [B, T, H * D] (Hugging Face's
    `attn_output * torch.sigmoid(gate)`; `invariant`: the sigmoid rounds every element alike, `ops/elementwise.py`)."""
    batch, length = out.shape[:2]
    return (out * elementwise.sigmoid(gate, invariant)).reshape(batch, length, -1)


def output_gate_w8a8_reference(out: torch.Tensor, gate: torch.Tensor, invariant: bool = False):
    """(gated, q, q_scale): `output_gate_reference`, then its rows' W8A8 quantization."""
    gated = output_gate_reference(out, gate, invariant).contiguous()
    return gated, *quantize_activations_reference(gated.reshape(-1, gated.shape[-1]))


@functools.cache  # build (and let Triton cache) the kernel once, on first use
def _output_gate_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def output_gate_rows(
        o_ptr, g_ptr, y_ptr, q_ptr, qs_ptr, T, H, so_b, so_t, so_h, sg_b, sg_t, sg_h,
        D: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = False, FLOOR: tl.constexpr = 0.0,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        # A program per (token, head): D values of the attention output and of the gate (both strided views), the
        # sigmoid rounded to the activation dtype, the product rounded again, stored at [token, head * D]. QUANT:
        # also o_proj's W8A8 input (q_ptr [tokens, H * D] e4m3, qs_ptr [tokens, H * D / 128]; D a multiple of 128).
        triton_utils.wait_for_previous_kernel(PDL)
        token, head = tl.program_id(0), tl.program_id(1)
        b, t = token // T, token % T
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        o = tl.load(o_ptr + b * so_b + t * so_t + head * so_h + cols, mask=mask, other=0.0)
        g = tl.load(g_ptr + b * sg_b + t * sg_t + head * sg_h + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g).to(o.dtype).to(tl.float32)
        y = (o.to(tl.float32) * sig).to(y_ptr.dtype.element_ty)
        row = token * H * D
        tl.store(y_ptr + row + head * D + cols, y, mask=mask)
        if QUANT:
            q_row, qs_row = q_ptr + row, qs_ptr + token * (H * D // 128)
            triton_utils.store_e4m3_groups(y.to(tl.float32), q_row, qs_row, head * D, H * D, BLOCK // 128, FLOOR)

    return output_gate_rows


def output_gate_triton(out: torch.Tensor, gate: torch.Tensor, quantize: bool = False):
    """Triton version of `output_gate_reference` (out, gate [B, T, H, D], any strides with a unit last one);
    `quantize`: (gated, e4m3 [B * T, H * D], fp32 scales [B * T, H * D / 128]) as `output_gate_w8a8_reference`
    gives them, the bytes `quantize_activation_rows_triton` gives the gated rows (D a multiple of 128)."""
    import triton

    batch, length, heads, dim = out.shape
    out, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (out, gate))
    gated = out.new_empty(batch, length, heads * dim)
    block = triton.next_power_of_2(dim)
    if quantize and (dim % FP8_BLOCK[1] or block != dim):
        raise ValueError(f"output_gate_triton(quantize=True) needs heads of a multiple of {FP8_BLOCK[1]}, got {dim}")
    tokens = batch * length
    q, q_scale = empty_w8a8_input(out, tokens, heads * dim) if quantize else (gated, gated)
    if tokens:
        _output_gate_kernel()[(tokens, heads)](
            out, gate, gated, q, q_scale, length, heads, out.stride(0), out.stride(1), out.stride(2),
            gate.stride(0), gate.stride(1), gate.stride(2), D=dim, BLOCK=block, QUANT=quantize, FLOOR=SCALE_FLOOR,
            **triton_utils.launch(out.device),
        )  # fmt: skip
    return (gated, q, q_scale) if quantize else gated


@torch.library.custom_op("qwen_mtp::output_gate", mutates_args=())
def output_gate(out: torch.Tensor, gate: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Custom op: `output_gate_reference` on CPU, one Triton launch on CUDA (a program per token and head:
    invariant either way)."""
    return output_gate_reference(out, gate, invariant).contiguous()


@cuda_kernel(output_gate)
def _(out, gate, invariant=False):
    if reference_forced("output_gate"):
        return output_gate_reference(out, gate, invariant).contiguous()
    return output_gate_triton(out, gate)


@output_gate.register_fake
def _(out, gate, invariant=False):
    return out.new_empty(out.shape[0], out.shape[1], out.shape[2] * out.shape[3])


@torch.library.custom_op("qwen_mtp::output_gate_w8a8", mutates_args=())
def output_gate_w8a8(
    out: torch.Tensor, gate: torch.Tensor, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Custom op: the output gate and its W8A8 quantization for o_proj (`output_gate_w8a8_reference`), the bytes
    o_proj's own quantization launch would write (`qwen_mtp::norm_w8a8` says why). One launch on CUDA."""
    return output_gate_w8a8_reference(out, gate, invariant)


@cuda_kernel(output_gate_w8a8)
def _(out, gate, invariant=False):
    if reference_forced("output_gate_w8a8"):
        return output_gate_w8a8_reference(out, gate, invariant)
    return output_gate_triton(out, gate, quantize=True)


@output_gate_w8a8.register_fake
def _(out, gate, invariant=False):
    batch, length, heads, dim = out.shape
    return out.new_empty(batch, length, heads * dim), *empty_w8a8_input(out, batch * length, heads * dim)


from qwen_mtp.ops.autograd import register_reference_autograd  # noqa: E402  (autograd: the reference's gradient)

register_reference_autograd(output_gate, output_gate_reference)
