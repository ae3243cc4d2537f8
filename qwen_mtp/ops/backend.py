"""Which implementation the ops run on CUDA: their Triton kernels (the default) or their plain-torch references.

The references are the documentation of the math and what CPU runs; forcing them on CUDA is for tests that
compare against Hugging Face's torch code bit for bit, and for bisecting a numerical difference to one kernel.
`QWEN_MTP_OPS=reference` in the environment forces them for the whole process; `reference_ops()` for a block.
The choice is read when an op runs, so CUDA graphs and compiled steps keep the one they were built with.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_forced = os.environ.get("QWEN_MTP_OPS", "").strip().lower() == "reference"


def reference_forced() -> bool:
    """True while the plain-torch references must run on every device."""
    return _forced


@contextmanager
def reference_ops(enabled: bool = True) -> Iterator[None]:
    """Run the ops' plain-torch references (also on CUDA) inside this block."""
    global _forced
    previous, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = previous
