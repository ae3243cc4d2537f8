"""Compile the W8A16 stream GEMM for Hopper (sm_90) on a machine without a GPU and print its SASS instruction
counts as JSON: Triton ships ptxas and cuobjdump, so the instructions the H200 would run can be read here. Run
without TRITON_INTERPRET (the interpreter replaces `triton.jit`); `test_linear_fp8_sass.py` runs it."""

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import GemmPlan


def sass_counts(plan: GemmPlan, n: int, k: int) -> dict[str, int]:
    """SASS opcode -> count for the plan's stream kernel on e4m3 weights and bf16 activations, specialised as a
    launch would be (16-divisible sizes and strides, 16-aligned pointers; M not specialised)."""
    fn = linear._stream_kernel()
    values = dict(M=1, N=n, K=k, sx_m=k, sw_n=k, ss_n=-(-k // 128), so_m=n, k_per_split=plan.k_per_split)
    pointers = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
    const = dict(SPLITS=plan.splits(k), BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k)
    const |= dict(ROW_TILES=plan.row_tiles, SWAP_AB=plan.swap_ab, FP8=True, INTERPRETED=False, PRECISION="tf32")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name != "M" and values[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=const, attrs=attrs)
    options = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True)
    return dict(collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass.stdout)))


if __name__ == "__main__":
    n, k, *fields = json.loads(sys.argv[1])
    print(json.dumps(sass_counts(GemmPlan(*fields), n, k)))
