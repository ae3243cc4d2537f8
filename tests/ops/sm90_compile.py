"""Compile the invariant GEMM for Hopper (sm_90) on a machine without a GPU and print, as JSON, the W8A16 stream
kernel's SASS instruction counts (Triton ships ptxas and cuobjdump, so the instructions the H200 would run can be
read here), or with "kwidth" first, the dot operand layouts' kWidth of the plan's kernel on e4m3 and on bf16
weights, or with "loops" first, the shared memory and K loops of a plan's kernel on bf16 weights. Run without
TRITON_INTERPRET (the interpreter replaces `triton.jit`); `test_linear_fp8_sass.py` and `test_linear_sass.py`
run it."""

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
        const |= dict(ROW_TILES=plan.row_tiles, SWAP_AB=plan.swap_ab, **linear.stream_stages(plan))
        const |= dict(TAIL_TILES=0, TAIL_SPLITS=1, TAIL_K_PER_SPLIT=0) | linear.stream_tail(plan, n, k)
    const |= dict(FP8=fp8, INTERPRETED=False, PRECISION="tf32", MMA_SYNC=fp8 and linear.feeds_mma_sync(plan, 9))
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


def _sass(compiled) -> str:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True)
    return sass.stdout


OPCODE = r"^(?:@!?U?P\w+\s+)?([A-Z][\w.]*)"


def sass_counts(plan: GemmPlan, n: int, k: int) -> dict[str, int]:
    """SASS opcode -> count for the plan's kernel on e4m3 weights and bf16 activations."""
    sass = _sass(compile_sm90(plan, n, k))
    return dict(collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass)))


def k_loops(plan: GemmPlan, n: int, k: int, fp8: bool = False) -> dict:
    """The plan's shared memory (bytes, what caps its programs per SM) and its innermost loops (the K loops, one
    per live row-tile count in the stream family): per loop its MMA instructions, 16-byte copies and the deepest
    cp.async wait (`DEPBAR.LE SB0, n`: groups still in flight while a K step computes, two per K step)."""
    compiled = compile_sm90(plan, n, k, fp8)
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _sass(compiled))
    program = [(int(address, 16), text.strip()) for address, text in lines]
    index = {address: i for i, (address, _) in enumerate(program)}
    spans = []
    for i, (address, text) in enumerate(program):
        target = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            spans.append((index[int(target.group(1), 16)], i))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    loops = []
    for a, b in innermost:
        body = [text for _, text in program[a : b + 1]]
        ops = collections.Counter(re.match(OPCODE, text).group(1) for text in body if re.match(OPCODE, text))
        mma = {op: count for op, count in ops.items() if op.startswith(("HGMMA", "HMMA"))}
        waits = [int(w, 16) for text in body for w in re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", text)]
        if mma:
            loops.append(dict(mma=mma, copies=ops.get("LDGSTS.E.BYPASS.128", 0), in_flight=max(waits, default=0)))
    return dict(shared=compiled.metadata.shared, loops=loops)


if __name__ == "__main__":
    if sys.argv[1] == "loops":
        n, k, *fields = json.loads(sys.argv[2])
        print(json.dumps(k_loops(GemmPlan(*fields[:-1], **fields[-1]), n, k)))
    elif sys.argv[1] == "kwidth":
        n, k, *fields = json.loads(sys.argv[2])
        plan = GemmPlan(*fields)
        print(json.dumps({"fp8": dot_kwidths(plan, n, k, True), "bf16": dot_kwidths(plan, n, k, False)}))
    else:
        n, k, *fields = json.loads(sys.argv[1])
        print(json.dumps(sass_counts(GemmPlan(*fields), n, k)))
