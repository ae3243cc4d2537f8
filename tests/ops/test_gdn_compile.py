"""The GDN prefill kernels compile for the H200 (sm_90) at Qwen3.5's real shapes (head dim 128, bf16), on a machine
without a GPU: Triton's own compiler and ptxas build the cubin, so a kernel that only the real shapes break (too
much shared memory, a dot shape the tensor cores refuse) fails here, not first on the GPU box. The interpreter
tests run tiny shapes and never compile."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

COMPILE = r"""
import json, os
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qwen_mtp.ops.gdn import chunked

decay_kkt, invert, wy, states, output = chunked._kernels()
DK = DV = 128
ints = lambda *names: {n: "i32" for n in names}
ptrs = lambda kind, *names: {n: kind for n in names}
common = dict(INTERPRETED=False, PRECISION=chunked.DOTS, PDL=False)
specs = {
    "decay_kkt": (decay_kkt, {**ptrs("*bf16", "k_ptr", "beta_ptr"), **ptrs("*fp32", "g_ptr"), "cu_ptr": "*i32",
                  **ptrs("*fp32", "a_ptr", "cum_ptr", "kf_ptr"), **ints("N", "HV", "GROUP", "s_kt", "s_kh", "s_gt")},
                  dict(C=64, DK=DK), chunked.PREPARE_WARPS, 3),
    "invert": (invert, {**ptrs("*fp32", "a_ptr", "t_ptr"), "HV": "i32"}, dict(C=64), chunked.INVERT_WARPS, 3),
    "wy": (wy, {**ptrs("*bf16", "k_ptr", "v_ptr", "beta_ptr"), "cu_ptr": "*i32",
                **ptrs("*fp32", "t_ptr", "cum_ptr", "w_ptr", "u_ptr"),
                **ints("N", "HV", "GROUP", "s_kt", "s_kh", "s_vt", "s_vh", "s_gt")}, dict(C=64, DK=DK, DV=DV),
           chunked.PREPARE_WARPS, 3),
    "states": (states, {"k_ptr": "*bf16", "cu_ptr": "*i32",
                        **ptrs("*fp32", "w_ptr", "u_ptr", "cum_ptr", "kf_ptr", "init_ptr", "h_ptr", "delta_ptr",
                               "final_ptr"), **ints("N", "HV", "GROUP", "s_kt", "s_kh")},
               dict(C=64, DK=DK, DV=DV, BLOCK_V=chunked.STATE_BLOCK_V, HAS_INIT=True), chunked.STATE_WARPS,
               chunked.STATE_STAGES),
    "output": (output, {**ptrs("*bf16", "q_ptr", "k_ptr", "out_ptr"), "cu_ptr": "*i32",
                        **ptrs("*fp32", "cum_ptr", "h_ptr", "delta_ptr"), "scale": "fp32",
                        **ints("N", "HV", "GROUP", "s_qt", "s_qh", "s_ot", "s_oh")},
               dict(C=64, DK=DK, DV=DV, BLOCK_V=chunked.OUTPUT_BLOCK_V), chunked.OUTPUT_WARPS, 3),
}
shared = {}
for name, (fn, signature, constants, warps, stages) in specs.items():
    constants = {**constants, **common}
    source = ASTSource(fn=fn, signature={**signature, **{c: "constexpr" for c in constants}}, constexprs=constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    shared[name] = kernel.metadata.shared
print(json.dumps(shared))
"""


def test_prefill_kernels_compile_for_h200_at_27b_shapes():
    root = str(Path(__file__).resolve().parents[2])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": root, "HOME": "/tmp"}  # no TRITON_INTERPRET: real kernels
    done = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(shared) == {"decay_kkt", "invert", "wy", "states", "output"}
    assert max(shared.values()) <= 227 * 1024, shared  # what one H200 SM offers a block
