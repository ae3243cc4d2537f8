"""Host microseconds per call of a few qwen_mtp ops on CUDA: through the dispatcher (`torch.ops.qwen_mtp.*`), as the
model calls them (the op objects inside `torch.inference_mode`: `ops.backend.DirectKernels` calls the CUDA kernel
directly), and the kernels' Python functions themselves; a cuBLAS `F.linear` for scale. Shapes are tiny so the GPU
keeps up and the time measured is the host's. Why: a 27B prefill chunk step (641 op calls) measured its host time
above its GPU time (benchmarks/mixed_steps.py --profile).
Usage (GPU box): python3 benchmarks/op_overhead.py"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from qwen_mtp.ops import linear as linear_ops
from qwen_mtp.ops import norm as norm_ops


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - started
    torch.cuda.synchronize()
    return 1e6 * host / calls


def main() -> None:
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    nw = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    plan = linear_ops.prefill_gemm_plan(256, 256)
    cases = {
        "F.linear (cuBLAS)": lambda: F.linear(x, w),
        "torch.ops.qwen_mtp.linear invariant (dispatcher)": lambda: torch.ops.qwen_mtp.linear(x, w, True),
        "linear_op invariant (as the model calls it)": lambda: linear_ops.linear_op(x, w, True),
        "invariant_matmul_triton (the kernel's function)": lambda: linear_ops.invariant_matmul_triton(x, w),
        "invariant_matmul_triton, a prefill plan": lambda: linear_ops.invariant_matmul_triton(x, w, plan),
        "torch.ops.qwen_mtp.rms_norm (dispatcher)": lambda: torch.ops.qwen_mtp.rms_norm(x, nw, 1e-6),
        "rms_norm (as the model calls it)": lambda: norm_ops.rms_norm(x, nw, 1e-6),
        "norm_triton (the kernel's function)": lambda: norm_ops.norm_triton(x, nw, 1e-6),
        "torch.empty": lambda: torch.empty(64, 256, device="cuda"),
    }
    with torch.inference_mode():  # as the engine runs
        for name, fn in cases.items():
            print(f"{per_call_us(fn):8.1f} us  {name}")


if __name__ == "__main__":
    main()
