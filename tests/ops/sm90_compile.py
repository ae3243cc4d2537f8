"""Compile the invariant GEMM for Hopper (sm_90) on a machine without a GPU and print, as JSON, the W8A16 stream
kernel's SASS instruction counts (Triton ships ptxas and cuobjdump, so the instructions the H200 would run can be
read here), or with "kwidth" first, the dot operand layouts' kWidth of the plan's kernel on e4m3 and on bf16
weights, or with "w8a8" first, the W8A8 kernel's opcode counts and wgmma operands. Run without TRITON_INTERPRET
(the interpreter replaces `triton.jit`); `test_linear_fp8_sass.py` and `test_linear_w8a8.py` run it."""

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


def compile_sm90(plan: GemmPlan, n: int, k: int, fp8: bool = True):
    """The plan's kernel on e4m3 (else bf16) weights and bf16 activations compiled for sm_90, specialised as a
    launch would be (16-divisible sizes and strides, 16-aligned pointers; M not specialised)."""
    fn = linear._stream_kernel() if plan.family == "stream" else linear._matmul_kernel()
    values = dict(M=1, N=n, K=k, sx_m=k, sw_n=k, ss_n=-(-k // 128), so_m=n, k_per_split=plan.k_per_split)
    pointers = dict(x_ptr="*bf16", w_ptr="*fp8e4nv" if fp8 else "*bf16", s_ptr="*fp32" if fp8 else "*bf16")
    pointers |= dict(out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
    const = dict(SPLITS=plan.splits(k), BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k)
    if plan.family == "stream":
        const |= dict(ROW_TILES=plan.row_tiles, SWAP_AB=plan.swap_ab)
    const |= dict(FP8=fp8, INTERPRETED=False, PRECISION="tf32", MMA_SYNC=fp8 and linear.feeds_mma_sync(plan, 9))
    return _compile(fn, values, pointers, const, plan)


def compile_w8a8_sm90(plan: GemmPlan, n: int, k: int):
    """The W8A8 kernel (`linear._w8a8_kernel`: e4m3 rows and weights, bf16 output) compiled for sm_90, specialised
    as a launch would be."""
    fn = linear._w8a8_kernel()
    values = dict(M=1, N=n, K=k, sq_m=k, sqs_m=k // 128, sw_n=k, ss_n=k // 128, so_m=n, k_per_split=plan.k_per_split)
    pointers = dict(q_ptr="*fp8e4nv", qs_ptr="*fp32", w_ptr="*fp8e4nv", s_ptr="*fp32", out_ptr="*bf16")
    pointers |= dict(part_ptr="*fp32", count_ptr="*i32")
    const = dict(SPLITS=plan.splits(k), BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k)
    const |= dict(ROW_TILES=plan.row_tiles, SWAP_AB=plan.swap_ab, INTERPRETED=False)
    return _compile(fn, values, pointers, const, plan)


def _compile(fn, values: dict, pointers: dict, const: dict, plan: GemmPlan):
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
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def dot_kwidths(plan: GemmPlan, n: int, k: int, fp8: bool) -> list[int]:
    """kWidth of every dot operand layout (in the TTGIR) the plan's kernel feeds its MMAs with."""
    ttgir = compile_sm90(plan, n, k, fp8).asm["ttgir"]
    dots = [line for line in ttgir.splitlines() if re.search(r"\b(tt\.dot|ttng\.warp_group_dot) ", line)]
    return [int(width) for line in dots for width in re.findall(r"kWidth = (\d+)", line)]


def sass(compiled) -> str:
    """The SASS of a compiled kernel (Triton's cuobjdump)."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        done = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True)
    return done.stdout


def opcode_counts(text: str) -> dict[str, int]:
    return dict(collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", text)))


def sass_counts(plan: GemmPlan, n: int, k: int) -> dict[str, int]:
    """SASS opcode -> count for the plan's kernel on e4m3 weights and bf16 activations."""
    return opcode_counts(sass(compile_sm90(plan, n, k)))


def w8a8_report(plan: GemmPlan, n: int, k: int) -> dict:
    """The W8A8 kernel's SASS opcode counts and its wgmma instructions' operand lists (`gdesc[...]`: an operand
    read from shared memory through a descriptor; a register there would be a register-fed A)."""
    text = sass(compile_w8a8_sm90(plan, n, k))
    operands = re.findall(r"([HQ]GMMA\.[\w.]+)\s+([^;]*);", text)
    return dict(ops=opcode_counts(text), wgmma=[f"{op} {args}" for op, args in operands])


if __name__ == "__main__":
    if sys.argv[1] == "w8a8":
        n, k, *fields = json.loads(sys.argv[2])
        print(json.dumps(w8a8_report(GemmPlan(*fields), n, k)))
    elif sys.argv[1] == "kwidth":
        n, k, *fields = json.loads(sys.argv[2])
        plan = GemmPlan(*fields)
        print(json.dumps({"fp8": dot_kwidths(plan, n, k, True), "bf16": dot_kwidths(plan, n, k, False)}))
    else:
        n, k, *fields = json.loads(sys.argv[1])
        print(json.dumps(sass_counts(GemmPlan(*fields), n, k)))
