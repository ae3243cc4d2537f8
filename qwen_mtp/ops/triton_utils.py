"""Running Triton here: whether kernels are interpreted on the CPU (tests) or compiled, and the shared `@triton.jit`
helpers (`triton_helpers.py`), which a kernel calls as `triton_utils.<helper>(...)`.

Why through this module: the interpreter resolves a kernel's names in its module's globals (a helper imported
inside the function that builds the kernel is invisible to it), while importing the ops must not need Triton (a
Linux-only dependency). So kernel modules import this module, and the helpers load on first use.
"""

from __future__ import annotations

import functools
import os

import torch

# Read once at import: Triton itself decides at kernel creation whether to interpret (tests on CPU set
# TRITON_INTERPRET=1 before importing qwen_mtp).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Programmatic dependent launch (`launch`): on unless QWEN_MTP_PDL=0 (the A/B switch of the benchmarks).
PDL_ENABLED = os.environ.get("QWEN_MTP_PDL", "1") != "0"


@functools.cache
def hopper_or_later(device) -> bool:
    """Whether a CUDA device is sm_90 or later: programmatic dependent launch, the tensor memory accelerator."""
    return torch.cuda.get_device_capability(device)[0] >= 9


# Pointers a kernel reads before its wait besides the weights' (`launch` says why that is safe), per kernel.
STATE_READS_BEFORE_THE_WAIT = {
    "gdn_recurrent_rows": {"pool_ptr", "rows_ptr", "committed_ptr", "alog_ptr", "dtb_ptr"},
    "conv_update_window": {"pool_ptr", "rows_ptr", "committed_ptr"},
}


def launch(device, fp_fusion: bool = True) -> dict:
    """The launch options every kernel of ours takes: `PDL` (its constexpr), Triton's `launch_pdl`, and
    `enable_fp_fusion` (`fp_fusion`: True unless the kernel must round as torch does).

    Why PDL: a decode step is ~800 dependent kernels of a few microseconds each, and between two of them the GPU
    drains one grid, then launches and ramps up the next. With programmatic dependent launch (Hopper on) a
    kernel's programs are launched while the previous kernel's last ones still run; each waits at
    `triton_helpers.wait_for_previous_kernel` until that kernel has finished and its writes are visible before it
    touches anything a kernel writes, so nothing it reads or writes can race, and the numbers are the same bits as
    without it. Only its weights (`w_ptr`: model parameters, never written while a step runs) may be read or
    prefetched before the wait, and a recurrent state kernel's own state (`STATE_READS_BEFORE_THE_WAIT`: the GDN
    delta rule's and the multi-token conv update's pool slot, with the batch's rows and start slots). Those are
    safe because a kernel lets the next one launch only after its own wait: when a kernel starts early, only the
    one just before it can still run, and that one never writes them (the conv update runs just before the delta
    rule, an input projection just before the conv update; their pools are written by the same kernels of the
    previous step). `tests/ops/test_pdl.py` checks every kernel's source for this.

    Only while a CUDA graph is being captured: there (the decode, verify and draft steps) kernels follow each
    other with no host time between them, and there it was measured (H200, 27B bf16 batch 1: the graphed forward
    14.62 -> 14.26 ms, `benchmarks/gpu_suite.sh` STAGE=pdl). Launched eagerly, a kernel waits for the host anyway
    (about 12 us a launch, with or without PDL: `benchmarks/pdl_launch.py`). Off under the interpreter, on CPUs
    and GPUs before sm_90, and with QWEN_MTP_PDL=0.

    Why `enable_fp_fusion`: Triton contracts a multiply and an add into one fused multiply-add unless told
    otherwise, and every figure, plan table and bitwise comparison of this engine was measured so (`sum_order`'s
    equalities across plans included). Triton 3.9 warns that its default becomes no contraction in 3.10, which
    would change the rounding of every kernel on a newer Triton; pinned here, a kernel compiles the same on every
    version. `fp_fusion=False` for the kernels that must round as torch does, a product before its sum (the
    sampler's, the penalties', q/k norm and rope)."""
    on = PDL_ENABLED and not INTERPRET and device.type == "cuda" and hopper_or_later(device)
    options = {"PDL": True, "launch_pdl": True} if on and torch.cuda.is_current_stream_capturing() else {"PDL": False}
    return options | {"enable_fp_fusion": fp_fusion}


def __getattr__(name: str):
    if name.startswith("__"):  # probes such as __wrapped__ or __path__ must not import Triton
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from qwen_mtp.ops import triton_helpers

    try:
        return getattr(triton_helpers, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
