"""Compile the invariant GEMM for Hopper (sm_90) on a machine without a GPU, with the arguments the launcher passes, and
print, as JSON, the W8A16 stream kernel's SASS instruction counts (Triton ships ptxas and cuobjdump, so the
instructions the H200 would run can be read here), or with "kwidth" first, the dot operand layouts' kWidth of the
plan's kernel on e4m3 and on bf16 weights, or with "loops" first, the shared memory and K loops of a plan's kernel on
bf16 weights, or with "compile" first, the launches (by name) that fail to compile, or with "w8a8" first, the W8A8
kernel's opcode counts and wgmma operands, or with "pdl" first, the grid dependency instructions of a kernel compiled
with and without programmatic dependent launch (with "stateloads" first, the global loads before and after it in the
recurrent state kernels), with "quantizing" first, the e4m3 conversions of the norm,
SwiGLU and output gate kernels that quantize their output, or with "tma" first, the "tma" kernel's MMA and
tensor-memory-accelerator instructions (with "tmaloads" first, a decode plan's with `tma_loads`; with "binaries", a
hash of every 27B decode GEMM binary). Run without TRITON_INTERPRET (the interpreter replaces `triton.jit`);
`test_linear_fp8_sass.py`, `test_linear_sass.py`, `test_linear_w8a8.py`, `test_pdl.py` and `test_linear_tma.py` run
it."""

import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qwen_mtp.ops import linear
from qwen_mtp.ops.linear import GemmPlan

POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv"}


def launch(plan: GemmPlan, n: int, k: int, fp8: bool = True):
    """The kernel `invariant_matmul_triton` launches for the plan on one bf16 row and an e4m3 (else bf16) [n, k]
    weight, and its arguments by name (the tensors on the meta device: their dtypes are what a launch passes; at
    one K split and no split tail, part_ptr and count_ptr are the bf16 output)."""
    kernel = linear._stream_kernel() if plan.family == "stream" else linear._matmul_kernel()
    args = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *values, **named: args.update(zip(kernel.arg_names, values, strict=False), **named)

    x = torch.empty(1, k, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device="meta")
    scale = torch.empty(-(-n // 128), -(-k // 128), dtype=torch.float32, device="meta") if fp8 else None
    factory = "_stream_kernel" if plan.family == "stream" else "_matmul_kernel"
    with mock.patch.object(linear, factory, Recorder), mock.patch("torch.cuda.get_device_capability", lambda _: (9, 0)):
        linear.invariant_matmul_triton(x, weight, plan, scale)
    return kernel, args


def compile_sm90(plan: GemmPlan, n: int, k: int, fp8: bool = True, **constexprs_set):
    """The plan's kernel on e4m3 (else bf16) weights and bf16 activations compiled for sm_90 with the arguments a
    launch passes (`launch`; `constexprs_set` replace some, e.g. PDL=True as under a graph capture), specialised as
    Triton specialises a launch (ints equal to 1 constant, 16-divisible ints and 16-aligned pointers marked so; M
    not specialised)."""
    kernel, args = launch(plan, n, k, fp8)
    args |= constexprs_set
    options = {name: args.pop(name) for name in ("num_warps", "num_stages")}
    descriptors = {}  # `GemmPlan.tma_loads` (bf16): the tiles' tensor descriptors (a CPU launch passes pointers)
    if plan.tma_loads and not fp8:
        args["TMA"] = True
        descriptors = {"x_ptr": f"tensordesc<bf16[{plan.block_m},{plan.block_k}]>",
                       "w_ptr": f"tensordesc<bf16[{plan.block_n},{plan.block_k}]>"}  # fmt: skip
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(inspect.signature(kernel.fn).parameters.items()):
        value = args.get(name, param.default)  # a constexpr the launch leaves at its default
        if name in descriptors:
            signature[name] = descriptors[name]
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = POINTER[value.dtype], [["tt.divisibility", 16]]
        elif kernel.params[i].is_constexpr or (value == 1 and not kernel.params[i].do_not_specialize):
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = "i32"
            if not kernel.params[i].do_not_specialize and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
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


def opcode_counts(text: str) -> dict[str, int]:
    return dict(collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", text)))


def sass_counts(plan: GemmPlan, n: int, k: int) -> dict[str, int]:
    """SASS opcode -> count for the plan's kernel on e4m3 weights and bf16 activations."""
    return opcode_counts(_sass(compile_sm90(plan, n, k)))


def compile_w8a8_sm90(plan: GemmPlan, n: int, k: int, **constexprs_set):
    """The W8A8 kernel (`linear._w8a8_kernel`: e4m3 rows and weights, bf16 output) compiled for sm_90, specialised
    as a launch would be (16-divisible sizes and strides, 16-aligned pointers; M not specialised; `constexprs_set`
    as in `compile_sm90`)."""
    fn = linear._w8a8_kernel()
    values = dict(M=1, N=n, K=k, sq_m=k, sqs_m=k // 128, sw_n=k, ss_n=k // 128, so_m=n, k_per_split=plan.k_per_split)
    pointers = dict(q_ptr="*fp8e4nv", qs_ptr="*fp32", w_ptr="*fp8e4nv", wp_ptr="*fp8e4nv", s_ptr="*fp32")
    pointers |= dict(out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
    const = dict(SPLITS=plan.splits(k), BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k)
    const |= dict(ROW_TILES=plan.row_tiles, SWAP_AB=plan.swap_ab, INTERPRETED=False, TMA=plan.tma_loads, PDL=False)
    const |= dict(L2_PREFETCH_K=0, L2_PREFETCH_BYTES=0) | constexprs_set
    descriptors = {}  # `GemmPlan.tma_loads`: the e4m3 blocks' tensor descriptors
    if plan.tma_loads:
        descriptors = {"q_ptr": f"tensordesc<fp8e4nv[{plan.block_m},{plan.block_k}]>",
                       "w_ptr": f"tensordesc<fp8e4nv[{plan.block_n},{plan.block_k}]>"}  # fmt: skip
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in descriptors:
            signature[name] = descriptors[name]
        elif name in const:
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


def w8a8_report(plan: GemmPlan, n: int, k: int) -> dict:
    """The W8A8 kernel's SASS opcode counts and its wgmma instructions' operand lists (`gdesc[...]`: an operand
    read from shared memory through a descriptor; a register there would be a register-fed A)."""
    text = _sass(compile_w8a8_sm90(plan, n, k))
    operands = re.findall(r"([HQ]GMMA\.[\w.]+)\s+([^;]*);", text)
    return dict(ops=opcode_counts(text), wgmma=[f"{op} {args}" for op, args in operands])


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


def compile_errors(launches: dict[str, list]) -> dict[str, str]:
    """name -> the compiler's error, for each launch ([n, k, fp8, plan fields, plan options]) that does not
    compile for sm_90 with the arguments the launcher passes (the CPU interpreter never compiles a kernel)."""
    errors = {}
    for name, (n, k, fp8, fields, options) in launches.items():
        try:
            compile_sm90(GemmPlan(*fields, **options), n, k, fp8)
        except Exception as error:  # every launch is tried: the report names all that fail
            errors[name] = f"{type(error).__name__}: {error}"[-2000:]
    return errors


def pdl_instructions() -> dict[str, list[str]]:
    """The grid dependency instructions in the PTX of the swiglu kernel (one of ours, small) compiled for sm_90
    with and without programmatic dependent launch (`triton_utils.launch`'s two settings)."""
    from qwen_mtp.ops import swiglu

    kernel = swiglu._swiglu_kernel()
    found = {}
    for pdl in (False, True):
        signature = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "INTER": "i32"}
        constexprs = {"BLOCK": 1024, "QUANT": False, "FLOOR": 0.0, "PDL": pdl}
        src = ASTSource(kernel, signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl}).asm["ptx"]
        found[str(pdl)] = re.findall(r"griddepcontrol\.\w+", ptx)
    return found


def quantizing_kernels() -> dict[str, int]:
    """The norm kernel (one-pass, one-pass in slices, chunked, gated per head), the SwiGLU and the output gate
    kernels compiled for sm_90 with QUANT (their output's W8A8 quantization, `triton_helpers.store_e4m3_groups`):
    per variant, the e4m3 conversions in its PTX."""
    from qwen_mtp.ops import norm, output_gate, swiglu

    found = {}
    norm_signature = {"x_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "d_ptr": "*bf16",
                      "sum_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "N": "i32", "eps": "fp32",
                      "g_heads": "i32", "g_s0": "i32", "g_s1": "i32"}  # fmt: skip
    variants = {"one pass, add": (True, False, True, 8192, 16, 0),
                "sliced, add": (True, False, True, 8192, 16, 1024),
                "chunked": (False, False, False, 1024, 4, 0),
                "gated heads": (False, True, False, 128, 4, 0)}  # fmt: skip
    for name, (whole_row, gated, add, block, warps, part) in variants.items():
        constexprs = {"GATED": gated, "ADD": add, "BLOCK": block, "WHOLE_ROW": whole_row, "QUANT": True,
                      "FLOOR": 1e-12, "PDL": True, "SLICE": part}  # fmt: skip
        src = ASTSource(norm._norm_kernel(), norm_signature | dict.fromkeys(constexprs, "constexpr"), constexprs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        found[f"norm {name}"] = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx))
    signature = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "INTER": "i32"}
    constexprs = {"BLOCK": 1024, "QUANT": True, "FLOOR": 1e-12, "PDL": True}
    src = ASTSource(swiglu._swiglu_kernel(), signature | dict.fromkeys(constexprs, "constexpr"), constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    found["swiglu"] = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx))
    signature = {"o_ptr": "*bf16", "g_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32",
                 **dict.fromkeys(("T", "H", "so_b", "so_t", "so_h", "sg_b", "sg_t", "sg_h"), "i32")}  # fmt: skip
    constexprs = {"D": 256, "BLOCK": 256, "QUANT": True, "FLOOR": 1e-12, "PDL": True}
    src = ASTSource(output_gate._output_gate_kernel(), signature | dict.fromkeys(constexprs, "constexpr"), constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    found["output gate"] = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx))
    return found


def tma_instructions(plan: GemmPlan, w8a8: bool = False) -> dict:
    """The "tma" kernel for a bf16 plan (with `w8a8`, on e4m3 rows and weights with their scales) compiled for
    sm_90 (host tensor descriptors of the plan's blocks): its wgmma (e4m3 ones counted apart), mma.sync and bulk
    tensor copy instructions in the PTX, and its shared memory."""
    kernel = linear._tma_kernel()
    operand = "fp8e4nv" if w8a8 else "bf16"
    signature = {"x_desc": f"tensordesc<{operand}[{plan.block_m},{plan.block_k}]>",
                 "w_desc": f"tensordesc<{operand}[{plan.block_n},{plan.block_k}]>",
                 "out_desc": f"tensordesc<bf16[{plan.block_m},{plan.block_n}]>",
                 "xs_ptr": "*fp32", "ws_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "sxs_m": "i32",
                 "sws_n": "i32"}  # fmt: skip
    constexprs = {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k, "GROUP_M": plan.group_m,
                  "INTERPRETED": False, "PRECISION": "tf32", "W8A8": w8a8, "PDL": False}  # fmt: skip
    signature |= dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(kernel, signature, constexprs=constexprs)
    options = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return copies_and_mmas(compiled) | {"e4m3_wgmma": len(re.findall(r"wgmma\.mma_async\S*e4m3", compiled.asm["ptx"]))}


def copies_and_mmas(compiled) -> dict:
    """A compiled kernel's wgmma, mma.sync and bulk tensor copy instructions (PTX) and its shared memory."""
    ptx = compiled.asm["ptx"]
    return {
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
        "tensor_copies": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "shared": compiled.metadata.shared,
    }


def tma_loads_report(plan: GemmPlan, n: int, k: int, w8a8: bool) -> dict:
    """The decode kernel of a plan with `tma_loads` (bf16 "grid" / "stream", else W8A8) compiled for sm_90:
    `copies_and_mmas`."""
    return copies_and_mmas(compile_w8a8_sm90(plan, n, k) if w8a8 else compile_sm90(plan, n, k, fp8=False))


def prefetch_report(plan: GemmPlan, n: int, k: int, kind: str) -> dict:
    """A decode plan with `l2_prefetch` compiled for sm_90 as a graph capture launches it (PDL on; the prefetch
    constexprs from `linear.l2_prefetch_columns`), `kind` "bf16", "w8a16" or "w8a8": its bulk L2 prefetches and
    where they stand against the grid dependency wait in the PTX."""
    element = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
    weight = torch.empty(n, k, dtype=element, device="meta")
    columns = linear.l2_prefetch_columns(plan, weight, pdl=True)
    if kind == "w8a8":
        compiled = compile_w8a8_sm90(plan, n, k, PDL=True, **columns)
    else:
        compiled = compile_sm90(plan, n, k, fp8=kind == "w8a16", PDL=True, **columns)
    ptx = compiled.asm["ptx"]
    prefetches = [m.start() for m in re.finditer(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)]
    wait = ptx.find("griddepcontrol.wait")
    return {"columns": columns, "prefetches": len(prefetches), "before_wait": all(p < wait for p in prefetches),
            "waits": ptx.count("griddepcontrol.wait"), "shared": compiled.metadata.shared}  # fmt: skip


def state_loads() -> dict[str, dict[str, int]]:
    """The GDN delta rule and the two conv update kernels compiled for sm_90 as a graph capture launches them (PDL
    on; the 27B's head and channel sizes): the global loads in their PTX before and after the grid dependency wait
    (`triton_utils.STATE_READS_BEFORE_THE_WAIT`: the state and the weights before, the new tokens after)."""
    from qwen_mtp.ops import conv
    from qwen_mtp.ops.gdn import recurrent

    def count(kernel, signature, constexprs, warps) -> dict[str, int]:
        src = ASTSource(kernel, signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs)
        ptx = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": True}
        ).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        loads = [m.start() for m in re.finditer(r"\bld\.global", ptx)]
        return {"before": sum(at < wait for at in loads), "after": sum(at > wait for at in loads),
                "waits": ptx.count("griddepcontrol.wait")}  # fmt: skip

    gdn = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "alog_ptr", "dtb_ptr", "out_ptr")}
    gdn |= {"pool_ptr": "*fp32", "rows_ptr": "*i32", "committed_ptr": "*i32", "T": "i32", "HV": "i32",
            "GROUP": "i32", "scale": "fp32"}  # fmt: skip
    gdn |= dict.fromkeys(("sq_b", "sq_t", "sq_h", "sv_b", "sv_t", "sv_h", "sa_b", "sa_t", "sp_r", "sp_s", "sp_h",
                          "so_b", "so_t", "so_h"), "i32")  # fmt: skip
    found = {"gdn_recurrent_rows": count(recurrent._gdn_recurrent_kernel(), gdn,
                                         {"DK": 128, "DV": 128, "BLOCK_V": 32, "PDL": True}, 4)}  # fmt: skip
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "pool_ptr": "*bf16", "rows_ptr": "*i32",
                 "committed_ptr": "*i32", "out_ptr": "*bf16"}  # fmt: skip
    signature |= dict.fromkeys(("T", "C", "W", "stride_xb", "stride_xt", "stride_ob", "stride_ot", "stride_pr",
                                "stride_pc"), "i32")  # fmt: skip
    found["conv_update_columns"] = count(conv._conv_update_columns_kernel(), signature,
                                         {"KERNEL": 4, "BLOCK_C": 128, "MAX_T": 8, "PDL": True}, 4)  # fmt: skip
    found["conv_update_window"] = count(conv._conv_update_kernel(), signature,
                                        {"KERNEL": 4, "BLOCK_C": 128, "MAX_T": 8, "FULL": 16, "TAPS": 4,
                                         "PDL": True}, 4)  # fmt: skip
    return found


def fma_contraction() -> dict[str, int]:
    """The fused multiply-adds in `y = a * b + c` compiled for sm_90 with Triton's default contraction turned off
    (TRITON_DEFAULT_FP_FUSION=0, Triton 3.10's announced default), with and without the fusion option our
    launches pass (`triton_utils.launch`)."""
    import triton.language as tl

    from qwen_mtp.ops import triton_utils

    @triton.jit
    def multiply_add(a_ptr, b_ptr, c_ptr, y_ptr):
        cols = tl.arange(0, 128)
        tl.store(y_ptr + cols, tl.load(a_ptr + cols) * tl.load(b_ptr + cols) + tl.load(c_ptr + cols))

    os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
    signature = dict.fromkeys(("a_ptr", "b_ptr", "c_ptr", "y_ptr"), "*fp32")
    found = {}
    pinned = {"enable_fp_fusion": triton_utils.launch(torch.device("cpu"))["enable_fp_fusion"]}
    for name, options in (("pinned", pinned), ("default", {})):
        compiled = triton.compile(
            ASTSource(multiply_add, signature), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}
        )
        found[name] = len(re.findall(r"\bfma\.rn\.f32", compiled.asm["ptx"]))
    return found


def decode_binaries() -> dict[str, str]:
    """A hash of the code (PTX without its debug sections and line records) of every decode GEMM binary the 27B
    runs (bf16 `TUNED` and `ROW_BUCKETS`, W8A16 `TUNED_FP8`, W8A8 `TUNED_W8A8` and `W8A8_ROW_BUCKETS`), for
    comparing two trees: a kernel refactor that leaves every hash alone leaves the H200's numbers alone."""
    import hashlib

    def code(compiled) -> str:
        ptx = re.split(r"\.section\s+\.debug", compiled.asm["ptx"])[0]
        ptx = "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*\.(loc|file)\b", line))
        return hashlib.sha1(ptx.encode()).hexdigest()

    wide = (16480, 5120, 14336, 34816, 248320)
    found = {}
    for (n, k), plan in linear.TUNED.items():
        if n in wide or k in (6144, 17408, 10240):
            found[f"bf16 {n}x{k} {plan}"] = code(compile_sm90(plan, n, k, fp8=False))
    for (n, k), entries in linear.ROW_BUCKETS.items():
        for fewest, plan in entries:
            found[f"bf16 {n}x{k} from {fewest} rows"] = code(compile_sm90(plan, n, k, fp8=False))
    for (n, k), plan in linear.TUNED_FP8.items():
        found[f"w8a16 {n}x{k}"] = code(compile_sm90(plan, n, k, fp8=True))
    for (n, k), plan in linear.TUNED_W8A8.items():
        found[f"w8a8 {n}x{k}"] = code(compile_w8a8_sm90(plan, n, k))
    for (n, k), entries in linear.W8A8_ROW_BUCKETS.items():
        for fewest, plan in entries:
            found[f"w8a8 {n}x{k} from {fewest} rows"] = code(compile_w8a8_sm90(plan, n, k))
    return found


if __name__ == "__main__":
    if sys.argv[1] == "prefetch":
        n, k, kind, *fields = json.loads(sys.argv[2])
        print(json.dumps(prefetch_report(GemmPlan(*fields[:-1], **fields[-1]), n, k, kind)))
    elif sys.argv[1] == "binaries":
        print(json.dumps(decode_binaries(), indent=0))
    elif sys.argv[1] == "tmaloads":
        n, k, w8a8, *fields = json.loads(sys.argv[2])
        print(json.dumps(tma_loads_report(GemmPlan(*fields[:-1], **fields[-1]), n, k, w8a8)))
    elif sys.argv[1] == "pdl":
        print(json.dumps(pdl_instructions()))
    elif sys.argv[1] == "fpfusion":
        print(json.dumps(fma_contraction()))
    elif sys.argv[1] == "stateloads":
        print(json.dumps(state_loads()))
    elif sys.argv[1] == "quantizing":
        print(json.dumps(quantizing_kernels()))
    elif sys.argv[1] == "tma":
        fields = json.loads(sys.argv[2])
        w8a8 = len(sys.argv) > 3 and json.loads(sys.argv[3])
        print(json.dumps(tma_instructions(GemmPlan(*fields[:-1], **fields[-1]), w8a8)))
    elif sys.argv[1] == "w8a8":
        n, k, *fields = json.loads(sys.argv[2])
        print(json.dumps(w8a8_report(GemmPlan(*fields), n, k)))
    elif sys.argv[1] == "compile":
        print(json.dumps(compile_errors(json.loads(sys.argv[2]))))
    elif sys.argv[1] == "loops":
        n, k, *fields = json.loads(sys.argv[2])
        print(json.dumps(k_loops(GemmPlan(*fields[:-1], **fields[-1]), n, k)))
    elif sys.argv[1] == "kwidth":
        n, k, *fields = json.loads(sys.argv[2])
        plan = GemmPlan(*fields)
        print(json.dumps({"fp8": dot_kwidths(plan, n, k, True), "bf16": dot_kwidths(plan, n, k, False)}))
    else:
        n, k, *fields = json.loads(sys.argv[1])
        print(json.dumps(sass_counts(GemmPlan(*fields), n, k)))
