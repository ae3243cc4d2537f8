"""Shared facts about running Triton here: whether kernels are interpreted on the CPU (tests) or compiled."""

from __future__ import annotations

import os

# Read once at import: Triton itself decides at kernel creation whether to interpret (tests on CPU set
# TRITON_INTERPRET=1 before importing qwen_mtp).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
