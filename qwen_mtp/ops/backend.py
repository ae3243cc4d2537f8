"""Which implementation the ops run on CUDA: their Triton kernels (the default) or their plain-torch references.

The references are the documentation of the math and what CPU runs; forcing them on CUDA is for tests that
compare against Hugging Face's torch code bit for bit, and for bisecting a numerical difference to one kernel.
`QWEN_MTP_OPS=reference` in the environment forces every op's for the whole process; `reference_ops()` every op's
for a block, `reference_ops("gdn_chunked", ...)` only the named ops'. Each op's CUDA implementation asks
`reference_forced("<its name>")` when it runs, so CUDA graphs and compiled steps keep the choice they were built with.

`cuda_kernel(op)` registers an op's CUDA implementation, and lets eager inference calls on CUDA run it without the
dispatcher (`DirectKernels`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch._library.custom_ops import CustomOpDef

# The custom ops `qwen_mtp::<name>` with a CUDA implementation of their own, nearly all Triton kernels
# (tests/ops/test_backend.py checks the list).
OPS = frozenset(
    {
        "add_rms_norm",
        "apply_penalties",
        "conv_prefill",
        "conv_prefill_varlen",
        "conv_update",
        "filter_threshold",
        "gate_values_varlen",
        "gated_rms_norm",
        "gdn_chunked",
        "gdn_chunked_varlen",
        "gdn_recurrent",
        "linear",
        "linear_fp8",
        "moe",
        "moe_route",
        "norm_w8a8",
        "output_gate",
        "output_gate_w8a8",
        "paged_attention",
        "paged_prefill_attention",
        "qk_norm_rope",
        "rms_norm",
        "sample_tokens",
        "swiglu",
        "swiglu_w8a8",
    }
)


def _forced_by_environment() -> frozenset[str]:
    value = os.environ.get("QWEN_MTP_OPS", "").strip().lower()
    if value not in ("", "reference"):
        raise ValueError(
            f"QWEN_MTP_OPS={value!r}: set it to 'reference' (every op's plain-torch reference, also on CUDA) "
            "or leave it unset (Triton kernels on CUDA)"
        )
    return OPS if value == "reference" else frozenset()


_forced = _forced_by_environment()


def reference_forced(op: str | None = None) -> bool:
    """True while `op`'s plain-torch reference must run on every device (`op` None: every op's)."""
    return _forced == OPS if op is None else op in _forced


@contextmanager
def reference_ops(*ops: str) -> Iterator[None]:
    """Run plain-torch references (also on CUDA) inside this block: every op's, or only those of the ops named
    (names from `OPS`, e.g. "gdn_chunked"). Ops forced outside the block stay forced inside it."""
    unknown = sorted(set(ops) - OPS)
    if unknown:
        raise ValueError(f"reference_ops: unknown ops {unknown}; the ops with a Triton kernel are {sorted(OPS)}")
    global _forced
    previous, _forced = _forced, _forced | (frozenset(ops) or OPS)
    try:
        yield
    finally:
        _forced = previous


class DirectKernels(CustomOpDef):
    """A custom op whose eager inference calls run its device implementation as a plain function call.

    Why: an eager prefill step calls ~640 ops at 27B. Through the dispatcher a call costs its Python custom-op
    wrapper, the schema's argument parsing, the dynamo-disabling guard and the outputs' aliasing check: about
    35-50 us each on the H200 machine's host (`benchmarks/op_overhead.py`), so a 512-token chunk step waited on
    its host rather than its GPU. A direct call runs the very function the dispatcher would, so the same kernels
    and the same numbers. Everything else keeps the dispatcher: torch.compile traces the op (under dynamo
    `is_compiling()`), autograd needs it (only inside `torch.inference_mode` is there none), a tensor on a device
    other than the current one needs its device guard, and `torch.ops.qwen_mtp.*` calls go through it as before."""

    _direct: dict[str, Callable]  # device type -> the implementation registered for it

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # first: dynamo traces this method, and only this branch
            return self._opoverload(*args, **kwargs)
        first = args[0] if args else None
        if (
            isinstance(first, torch.Tensor)
            and torch.is_inference_mode_enabled()
            and first.device.type in self._direct
            and (first.device.index is None or first.device.index == torch.cuda.current_device())
        ):
            implementation = self._direct[first.device.type]
            return implementation(*args, **kwargs)
        return self._opoverload(*args, **kwargs)  # what `CustomOpDef.__call__` does


def device_kernel(op: CustomOpDef, device_type: str = "cuda") -> Callable[[Callable], Callable]:
    """Decorator: `fn` is `op`'s implementation on `device_type` (`op.register_kernel`), which eager inference
    calls of `op` on such tensors also run directly (`DirectKernels`). The op's first argument must be a tensor."""

    def register(fn: Callable) -> Callable:
        op.register_kernel(device_type)(fn)
        op.__class__ = DirectKernels  # the same object: opcheck, torch.ops and compile see the op as before
        op._direct = {**getattr(op, "_direct", {}), device_type: fn}
        return fn

    return register


def cuda_kernel(op: CustomOpDef) -> Callable[[Callable], Callable]:
    """`device_kernel(op, "cuda")`: `fn` is `op`'s CUDA implementation, which eager inference calls on CUDA tensors
    run directly."""
    return device_kernel(op, "cuda")
