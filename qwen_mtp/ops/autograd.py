"""Autograd for our fused ops: the gradient of each op's plain-torch reference.

An op's Triton kernel is a faster way to compute its reference, so the gradient of the reference is the
gradient of the op. Backward recomputes the reference from the saved inputs under autograd (the fused forward
keeps nothing for it) and differentiates that: the same function on every device, so the model has one
differentiable path and training runs the same layer code as inference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def register_reference_autograd(op, reference: Callable) -> None:
    """Make custom op `op` differentiable through `reference`, a function of the same arguments returning the
    same outputs (a tensor or a tuple of tensors). Non-tensor arguments (eps, None) are passed through."""

    def setup_context(ctx, inputs, output):
        ctx.arguments = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.tensor_positions = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.wants_grad = ctx.needs_input_grad  # per input, as torch passes it here
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_positions))

    def backward(ctx, *grads):
        arguments = list(ctx.arguments)
        for i, tensor in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            arguments[i] = tensor.detach().requires_grad_(ctx.wants_grad[i])
        wanted = [i for i in ctx.tensor_positions if ctx.wants_grad[i]]
        result: list[torch.Tensor | None] = [None] * len(arguments)
        with torch.enable_grad():
            outputs = reference(*arguments)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(out, g) for out, g in zip(outputs, grads, strict=True) if g is not None and out.requires_grad]
            if wanted and pairs:
                found = torch.autograd.grad(
                    [out for out, _ in pairs],
                    [arguments[i] for i in wanted],
                    [g for _, g in pairs],
                    allow_unused=True,
                )
                for i, grad in zip(wanted, found, strict=True):
                    result[i] = grad
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)
