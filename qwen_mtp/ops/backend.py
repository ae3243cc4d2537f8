"""Which implementation the ops run on CUDA: their Triton kernels (the default) or their plain-torch references.

The references are the documentation of the math and what CPU runs; forcing them on CUDA is for tests that
compare against Hugging Face's torch code bit for bit, and for bisecting a numerical difference to one kernel.
`QWEN_MTP_OPS=reference` in the environment forces every op's for the whole process; `reference_ops()` every op's
for a block, `reference_ops("gdn_chunked", ...)` only the named ops'. Each op's CUDA implementation asks
`reference_forced("<its name>")` when it runs, so CUDA graphs and compiled steps keep the choice they were built with.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

# The custom ops `qwen_mtp::<name>` with a CUDA implementation of their own, nearly all Triton kernels
# (tests/ops/test_backend.py checks the list).
OPS = frozenset(
    {
        "add_rms_norm",
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
