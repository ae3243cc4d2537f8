"""What a one-row W8A8 launch does beyond reading its weight (issue #14; a probe).

The W8A8 one-row GEMMs take 4-7 us more than a kernel that only reads the same bytes in one launch (thirty-fourth
session, H100, `launch_floor.py`). This script rebuilds the engine's one-row launch (`linear._w8a8_kernel` at one row
tile: the shape's plan, its K splits, tiles loaded by tensor descriptors, swapped e4m3 MMAs scaled in fp32 by an
explicit fused multiply-add) and takes parts away, one at a time:
- `full`: all of it. Its rows must equal the engine's bit for bit (checked), and it should time as the engine does;
- `no scales`: the block products are added unscaled (no weight or activation scale loads);
- `no MMA`: the weight blocks are summed along K instead of multiplied (no activation loads, no MMA, no scales);
- `no split sums`: `full` with the partials stored and never added (the output is left unwritten);
- `full, tile-major` and `no MMA, tile-major`: the weight stored tile by tile (`tile_major`), so each K step reads
  one contiguous block; `full, tile-major` must still equal the engine bit for bit (same values, same MMAs).
Each against the engine's launch and the read floor of the same bytes (`launch_floor.read_launch`, the fastest of its
grids) in the same process, at M = 1, for o_proj / out_proj and down (the two furthest from their floors). Not GEMMs
except `full`: they only say where the time goes.

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/w8a8_costs.py [--out PATH]
"""

from __future__ import annotations

import argparse
import functools

import torch
from gemm_family import ROTATION_BYTES, _cdiv, graph_us, write_json
from gemm_fp8 import random_fp8
from launch_floor import read_times

from qwen_mtp.ops import linear, triton_utils

SHAPES = {"o_proj": (5120, 6144), "down": (5120, 17408)}
MODES = {"full": 0, "no scales": 1, "no MMA": 2, "no split sums": 3}


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def w8a8_one_tile(
        q_desc, qs_ptr, w_desc, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, sqs_m, ss_n, so_m, k_per_split,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr, TILED: tl.constexpr = False,
    ):  # fmt: skip
        triton_utils.wait_for_previous_kernel(PDL)
        pid_n, split = tl.program_id(0), tl.program_id(1)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        k_start = split * k_per_split * BLOCK_K
        k_end = tl.minimum(K, k_start + k_per_split * BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            kb = k0 // BLOCK_K
            if TILED:  # the weight stored tile by tile: this block is BLOCK_N x BLOCK_K contiguous bytes
                w = w_desc.load([(pid_n * tl.cdiv(K, BLOCK_K) + kb) * BLOCK_N, 0])
            else:
                w = w_desc.load([pid_n * BLOCK_N, k0])  # [BLOCK_N, BLOCK_K] e4m3
            if MODE == 2:
                acc += tl.sum(w.to(tl.float32), axis=1)[:, None]
            else:
                x = q_desc.load([0, k0])  # [BLOCK_M, BLOCK_K] e4m3
                prod = tl.dot(w, tl.trans(x), input_precision="ieee")
                if MODE == 1:
                    acc += prod
                else:
                    w_scale = tl.load(s_ptr + (ns // 128) * ss_n + kb, mask=ns < N, other=0.0)
                    x_scale = tl.load(qs_ptr + rows * sqs_m + kb, mask=rows < M, other=0.0)
                    acc = tl.fma(prod, w_scale[:, None] * x_scale[None, :], acc)
        acc = tl.trans(acc)
        ms = rows.to(tl.int64)
        mask = (ms[:, None] < M) & (ns[None, :] < N)
        plane = M.to(tl.int64) * N
        tile = ms[:, None] * N + ns[None, :]
        tl.store(part_ptr + split * plane + tile, acc, mask=mask)
        if MODE != 3:
            tl.debug_barrier()
            counter = count_ptr + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # the engine's: the last adds in split order
                total = tl.load(part_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, SPLITS):
                    total += tl.load(part_ptr + s * plane + tile, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + ms[:, None] * so_m + ns[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter, 0, sem="relaxed")

    return w8a8_one_tile


def tile_major(w: torch.Tensor, plan) -> torch.Tensor:
    """The weight's [block_n, block_k] tiles stored one after another (N tile by N tile, K block by K block), as
    [tiles x block_n, block_k]: each K step of a program then reads one contiguous block instead of block_n rows of
    block_k bytes each. The same values: a layout a loader could write once."""
    n, k = w.shape
    bn, bk = plan.block_n, plan.block_k
    assert n % bn == 0 and k % bk == 0
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous().view(-1, bk)


def launch(q, q_scale, w, scale, plan, counters, mode: int = 0, tiled: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's one-row W8A8 launch (`plan`'s tiles and K splits, one row tile), less what `mode` drops; with
    `tiled` (`tile_major(w)`), its weight blocks read from that layout instead."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = q.shape, w.shape[0]
    assert m <= plan.block_m and plan.swap_ab and plan.splits(k) > 1
    splits = plan.splits(k)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=q.device)
    _kernel()[(triton.cdiv(n, plan.block_n), splits)](
        TensorDescriptor.from_tensor(q, [plan.block_m, plan.block_k]), q_scale,
        TensorDescriptor.from_tensor(w if tiled is None else tiled, [plan.block_n, plan.block_k]), scale, out, part,
        counters, m, n, k,
        q_scale.stride(0), scale.stride(0), out.stride(0), plan.k_per_split,
        SPLITS=splits, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, STAGES=plan.num_stages,
        MODE=mode, TILED=tiled is not None, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **triton_utils.launch(q.device),
    )  # fmt: skip
    return out


def shape_entry(n: int, k: int) -> dict:
    loads = linear.TMA_LOAD_BUCKETS["w8a8"]
    plan = linear.row_plan(n, k, 1, True, linear.W8A8_ROW_BUCKETS, linear.gemm_plan_w8a8, loads)
    copies = max(1, _cdiv(ROTATION_BYTES, n * k))
    # (weight, its block scales, its tile-major copy), rotated past L2
    weights = [(w, sc, tile_major(w, plan)) for w, sc in (random_fp8(n, k, seed) for seed in range(copies))]
    q, q_scale = linear.quantize_activation_rows_triton(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
    counters = torch.zeros(1 << 12, dtype=torch.int32, device="cuda")

    def engine(a, ws):  # graph_us calls fn(rows, weight): the rows' scales ride along
        return linear.w8a8_matmul_triton(a, q_scale, ws[0], ws[1])

    entry = dict(n=n, k=k, mb=n * k / 1e6, plan=str(plan), engine_us=graph_us(engine, q, weights))
    reference = engine(q, weights[0])
    entry["modes"] = {}
    runs = [(label, mode, False) for label, mode in MODES.items()]
    runs += [("full, tile-major", 0, True), ("no MMA, tile-major", 2, True)]
    for label, mode, from_tiles in runs:

        def fn(a, ws, mode=mode, from_tiles=from_tiles):
            return launch(a, q_scale, ws[0], ws[1], plan, counters, mode, tiled=ws[2] if from_tiles else None)

        entry["modes"][label] = dict(us=graph_us(fn, q, weights))
        if mode == 0:
            entry["modes"][label]["equal_to_engine"] = bool(torch.equal(fn(q, weights[0]), reference))
    flat = [w.view(torch.int32).view(-1) for w, _, _ in weights]  # the same bytes, read as int32
    entry["read_floor_us"] = min(read_times(flat).values())
    del weights, flat
    torch.cuda.empty_cache()
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shapes={})
    for name, (n, k) in SHAPES.items():
        e = report["shapes"][name] = shape_entry(n, k)
        floor = e["read_floor_us"]
        print(f"{name} {n}x{k} ({e['mb']:.1f} MB e4m3), M = 1, us (over the read floor); {e['plan']}")
        print(f"  {'read floor':16s}{floor:6.1f}")
        print(f"  {'engine':16s}{e['engine_us']:6.1f} (+{e['engine_us'] - floor:.1f})")
        for label, r in e["modes"].items():
            same = {True: "  rows equal the engine's", False: "  ROWS DIFFER from the engine's"}.get(
                r.get("equal_to_engine"), ""
            )
            print(f"  {label:16s}{r['us']:6.1f} (+{r['us'] - floor:.1f}){same}")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
