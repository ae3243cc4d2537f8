"""Where the invariant GEMM's gap to cuBLAS at 64-128 rows goes, on the N = 5120 shapes (issue #13).

At one row our "stream" GEMM matches cuBLAS; from 64 rows the shapes with 40 output tiles of 128 columns (o_proj /
out_proj, down, the MTP fc) fall behind (1.2-1.4x at 64-128 rows, `gemm_buckets.py --set dispatch`). Their K split
points (3 splits: what fixes a row's bits, `linear.sum_order`, and what one row needs to fill the GPU) hold at every
M, and the tile searches (`gemm_buckets.py --set tiles|deep|buckets|splits`) found nothing faster. This script
takes the launch apart. Its kernel is the stream kernel's one-row-tile K loop (swapped wgmma, the engine plan's K
split points, tiles loaded by tensor descriptors) with three ways to finish the K splits:
- `last`: the engine's. Each split stores its fp32 partials; the last of a tile's splits to arrive (an atomic
  counter) adds them in split order 0, 1, ... and stores the output. Its rows must equal the engine's bit for bit
  (checked at every M);
- `none`: the partials are stored and nothing else (the output is left unwritten): not a GEMM, the floor that any
  reduction of these partials starts from;
- `shared`: each split waits for its siblings, then adds every SPLITS-th 16 rows of the tile (same order, so the
  same bits, checked). A diagnostic only: its spin-wait needs every split of a tile resident at once, which CUDA
  does not promise; the engine never waits on another program;
- `last, loads at once`: `last` with the partials' loads unrolled, all issued before the first add;
- `last, own from registers`: `last` where the last split adds its own partial from its registers, reading one
  partial fewer (both: the engine's order, checked).
`--warp-specialize` adds each tile with `tl.range(..., warp_specialize=True)` (a producer warp group issuing the
loads, Triton 3.4+ on Hopper). Off by default: with Triton 3.6 on an H100 it compiled and then never finished
(docs/benchmark-log.md, thirty-fourth session).

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/gemm_split_costs.py [--shapes o_proj,down]
[--warp-specialize] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from gemm_family import ROTATION_BYTES, _cdiv, graph_us, write_json

from qwen_mtp.ops import linear

SHAPES = {"o_proj": (5120, 6144), "mtp_fc": (5120, 10240), "down": (5120, 17408)}  # 27B: (N, K)
# (block_n, block_m, block_k, warps, stages) -> the row counts it is timed at (a 64-row tile only where it is one)
TILES = {(128, 64, 128, 8, 3): (64,), (128, 128, 128, 8, 3): (64, 96, 128), (128, 128, 64, 4, 4): (64, 96, 128)}
ROWS = (64, 96, 128)
REDUCTIONS = {"last": 1, "none": 0, "shared": 2, "last, loads at once": 3, "last, own from registers": 4}


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def split_k_swapped(
        x_desc, w_desc, out_ptr, part_ptr, count_ptr, M, N, K, so_m, k_per_split,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, WS: tl.constexpr, REDUCE: tl.constexpr = 1,
    ):  # fmt: skip
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        k_start = split * k_per_split * BLOCK_K
        k_end = tl.minimum(K, k_start + k_per_split * BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
            w = w_desc.load([pid_n * BLOCK_N, k0])
            x = x_desc.load([pid_m * BLOCK_M, k0])
            acc += tl.dot(w, tl.trans(x))
        acc = tl.trans(acc)
        ms = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (ms[:, None] < M) & (ns[None, :] < N)
        if SPLITS == 1:
            tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            plane = M.to(tl.int64) * N
            tile = ms[:, None] * N + ns[None, :]
            tl.store(part_ptr + split * plane + tile, acc, mask=mask)
            if REDUCE == 0:  # the diagnostic: what the split reduction costs (the output is left unwritten)
                return
            tl.debug_barrier()
            counter = count_ptr + pid_n * tl.num_programs(2) + pid_m
            if REDUCE >= 3:  # the engine's order; every load issued at once (3), the last split's own in registers (4)
                if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                    parts = ()
                    for s in tl.static_range(SPLITS):
                        if REDUCE == 4:
                            others = mask & (ms[:, None] * 0 + split != s)  # a tensor: the interpreter's mask
                            p = tl.load(part_ptr + s * plane + tile, mask=others, other=0.0, cache_modifier=".cg")
                            p = tl.where(split == s, acc, p)
                        else:
                            p = tl.load(part_ptr + s * plane + tile, mask=mask, other=0.0, cache_modifier=".cg")
                        parts = parts + (p,)
                    total = parts[0]
                    for s in tl.static_range(1, SPLITS):
                        total += parts[s]
                    tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(counter, 0, sem="relaxed")
            elif REDUCE == 1:  # the engine's: the last split to arrive adds the partials in order 0, 1, ..
                if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                    total = tl.load(part_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
                    for s in range(1, SPLITS):
                        total += tl.load(part_ptr + s * plane + tile, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(counter, 0, sem="relaxed")
            else:  # shared: every split waits for its siblings, then adds (in the same order) every SPLITS-th 16 rows
                seen = tl.atomic_add(counter, 1, sem="acq_rel") + 1
                while seen < SPLITS:  # needs every split of the tile resident at once: the grid fits the GPU here
                    seen = tl.atomic_add(counter, 0, sem="acquire")
                for c in range(split, BLOCK_M // 16, SPLITS):
                    rs = (pid_m * BLOCK_M + c * 16 + tl.arange(0, 16)).to(tl.int64)
                    chunk = rs[:, None] * N + ns[None, :]
                    cmask = (rs[:, None] < M) & (ns[None, :] < N)
                    total = tl.load(part_ptr + chunk, mask=cmask, other=0.0, cache_modifier=".cg")
                    for s in range(1, SPLITS):
                        total += tl.load(part_ptr + s * plane + chunk, mask=cmask, other=0.0, cache_modifier=".cg")
                    out = total.to(out_ptr.dtype.element_ty)
                    tl.store(out_ptr + rs[:, None] * so_m + ns[None, :], out, mask=cmask)
                if tl.atomic_add(counter, 1, sem="acq_rel") == 2 * SPLITS - 1:  # every sibling is past its wait
                    tl.atomic_xchg(counter, 0, sem="relaxed")

    return split_k_swapped


def launch(x: torch.Tensor, w: torch.Tensor, tile: tuple, split_elems: int, ws: bool, counters: torch.Tensor, reduce=1):
    """x @ w^T cut into K splits of `split_elems` columns (the engine plan's points), one row tile a program,
    finished by `reduce` (1: last, 0: none, 2: shared; module docstring)."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, block_m, block_k, warps, stages = tile
    (m, k), n = x.shape, w.shape[0]
    splits = _cdiv(k, split_elems)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))
    _kernel()[grid](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
        out, part, counters, m, n, k, out.stride(0), split_elems // block_k,
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, WS=ws, REDUCE=reduce,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def shape_entry(n: int, k: int, warp_specialize: bool) -> dict:
    plan = linear.gemm_plan(n, k)
    split_elems = min(plan.k_per_split * plan.block_k, k)
    copies = max(1, _cdiv(ROTATION_BYTES, n * k * 2))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    engine_rows = linear.invariant_matmul_triton(x, weights[0])  # equal to its rows at every M (dispatch table)
    entry = dict(n=n, k=k, split_elems=split_elems, cublas_us={}, engine_us={}, variants={})
    for m in ROWS:
        entry["cublas_us"][m] = graph_us(F.linear, x[:m], weights)
        entry["engine_us"][m] = graph_us(lambda a, w: linear.invariant_matmul_triton(a, w), x[:m], weights)
    for tile, rows in TILES.items():
        for ws in (False, True) if warp_specialize else (False,):
            for reduction, code in REDUCTIONS.items():
                label = f"bn{tile[0]} bm{tile[1]} k{tile[2]} w{tile[3]} s{tile[4]}{' ws' if ws else ''} {reduction}"

                def fn(a, w, tile=tile, ws=ws, code=code):
                    return launch(a, w, tile, split_elems, ws, counters, code)

                try:
                    equal = {m: bool(torch.equal(fn(x[:m], weights[0]), engine_rows[:m])) for m in rows if code}
                    us = {m: graph_us(fn, x[:m], weights) for m in rows}
                except Exception as err:  # a variant that does not compile (warp specialization on Hopper)
                    entry["variants"][label] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
                    print(f"  {label}: {entry['variants'][label]['error']}", flush=True)
                    continue
                entry["variants"][label] = dict(us=us, equal_to_engine=equal)
    del weights, x
    torch.cuda.empty_cache()
    return entry


def print_entry(name: str, e: dict) -> None:
    print(f"{name} {e['n']}x{e['k']}, K splits of {e['split_elems']}: us (x cuBLAS); '!' = rows differ from the engine")
    print(f"  {'':38}" + "".join(f"M={m:<13}" for m in ROWS))
    print(f"  {'cuBLAS':38}" + "".join(f"{e['cublas_us'][m]:<15.1f}" for m in ROWS))
    lines = [("engine (shipped plans)", e["engine_us"], {})]
    lines += [(label, v["us"], v["equal_to_engine"]) for label, v in e["variants"].items() if "us" in v]
    for label, us, equal in lines:
        cells = "".join(
            f"{us[m]:6.1f} ({us[m] / e['cublas_us'][m]:.2f}){'!' if equal.get(m) is False else ' '} " if m in us
            else f"{'-':15}"
            for m in ROWS
        )  # fmt: skip
        print(f"  {label:38}{cells}")


def main() -> None:
    import triton

    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--warp-specialize", action="store_true", help="also each tile with warp specialization")
    parser.add_argument("--out")
    args = parser.parse_args()
    t0 = time.time()
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, shapes={})
    for name in args.shapes.split(","):
        report["shapes"][name] = shape_entry(*SHAPES[name], args.warp_specialize)
        print_entry(name, report["shapes"][name])
    report["seconds"] = round(time.time() - t0, 1)
    write_json(args.out, report)
    print(f"{report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
