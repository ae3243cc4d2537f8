"""Running Triton here: whether kernels are interpreted on the CPU (tests) or compiled, and the shared `@triton.jit`
helpers (`triton_helpers.py`), which a kernel calls as `triton_utils.<helper>(...)`.

Why through this module: the interpreter resolves a kernel's names in its module's globals (a helper imported
inside the function that builds the kernel is invisible to it), while importing the ops must not need Triton (a
Linux-only dependency). So kernel modules import this module, and the helpers load on first use.
"""

from __future__ import annotations

import os

# Read once at import: Triton itself decides at kernel creation whether to interpret (tests on CPU set
# TRITON_INTERPRET=1 before importing qwen_mtp).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def __getattr__(name: str):
    if name.startswith("__"):  # probes such as __wrapped__ or __path__ must not import Triton
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from qwen_mtp.ops import triton_helpers

    try:
        return getattr(triton_helpers, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
