"""Inputs and glue for the op tests (one file per op): each Triton kernel equals its plain-PyTorch reference, updates
the pools the same way and is batch-invariant; on CPU under TRITON_INTERPRET=1 (tiny shapes, fp32 / fp16 inputs),
on CUDA when there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]

# The verify == decode (bit for bit) and batch-invariance tests, the property MTP-on == MTP-off rests on, run at
# Qwen3.5-0.8B's shapes on CUDA (bf16) and at tiny ones under the CPU interpreter.
REAL = torch.cuda.is_available()
VERIFY_DTYPE = torch.bfloat16 if REAL else torch.float32


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def close(a, b, dtype):
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def fused_projection(batch, length, sizes, dtype=torch.float32, seed=1):
    """Slices of one [B, T, sum(sizes)] projection output, as the fused GEMMs hand them to the ops."""
    return torch.split(rand(batch, length, sum(sizes), dtype=dtype, seed=seed), sizes, dim=-1)


def naive_inputs(length, hk=2, hv=4, dk=16, dv=8, seed=0):
    """q, k, v, log decay, beta and an initial state for two sequences (fp32, on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, length, hk, dk, generator=g)
    k = torch.randn(2, length, hk, dk, generator=g)
    v = torch.randn(2, length, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(2, length, hv, generator=g))
    beta = torch.rand(2, length, hv, generator=g)
    state = torch.randn(2, hv, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


def paged_setup(length, dtype):
    """A KV cache of 12 pages of 8 slots (2 KV heads, head dim 32) holding 3 requests' contexts (20, 9 and 29
    positions) on scattered pages, their last `length` positions just written, and their queries (4 heads)."""
    from qwen_mtp.ops.paged_attention import write_kv

    kv = rand(2, 12, 8, 2, 32, dtype=dtype, seed=1)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [9, 10, 11, 4]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 9, 29], dtype=torch.int32, device=DEVICE)
    q = rand(3, length, 4, 32, dtype=dtype, seed=2)
    k, v = rand(3, length, 2, 32, dtype=dtype, seed=3), rand(3, length, 2, 32, dtype=dtype, seed=4)
    write_kv(k, v, kv, tables, lens[:, None].long() - length + torch.arange(length, device=DEVICE))
    return q, kv, tables, lens


def strided_attention_step(length=2):
    """A step's q [B, T, H, D] as a transposed view and new k, v [B, T, KV, D] transposed, as the model hands
    them over, with the cache they go into and the positions they take."""
    q, kv, tables, lens = paged_setup(length, torch.float32)
    kvh, dim = kv.shape[3], kv.shape[4]
    k_new = rand(q.shape[0], kvh, length, dim, dtype=torch.float32).transpose(1, 2)  # [B, T, KV, D], transposed
    positions = (lens - length)[:, None].long() + torch.arange(length, device=DEVICE)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, T, H, D] as a transposed view
    return (q_t, k_new, k_new.clone(), kv, tables, lens, positions, dim**-0.5)


def check_op(op, args):
    """The op's fake (meta) kernel agrees with its real one (shapes, strides, mutation) on these inputs, as
    torch.compile relies on, and every output is contiguous, as the fakes promise on every device."""
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    outputs = op(*args)
    for out in outputs if isinstance(outputs, tuple) else (outputs,):
        assert out.is_contiguous()


def sm90_report(*args):
    """What `tests/ops/sm90_compile.py` prints (JSON) for `args` (a mode name, then JSON-able values): the kernels
    compiled for the H200 (sm_90) here, in a process without TRITON_INTERPRET (the interpreter replaces
    `triton.jit`). Skips where Triton's wheels ship no CUDA toolchain (ptxas, cuobjdump)."""
    if sys.platform != "linux":
        pytest.skip("Triton's CUDA toolchain (ptxas, cuobjdump) ships in its Linux wheels")
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
    command = [sys.executable, str(root / "tests" / "ops" / "sm90_compile.py")]
    command += [arg if isinstance(arg, str) else json.dumps(arg) for arg in args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
