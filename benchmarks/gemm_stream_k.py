"""Would a stream-K partition speed up the one-row GEMMs of the N = 5120 shapes? (issues #13, #14; a probe)

At one row (one request's decode) the 27B's o_proj / out_proj, down and MTP fc weights have 40 output tiles of 128
columns. Their plans cut K into 3 splits: 120 programs on a 132-SM GPU, so 12 SMs stream nothing, and a fourth
split (160 programs: a second, partial wave) was slower (twenty-fourth session). A stream-K partition gives each of
P programs an equal, contiguous run of the (tile, K block) units, crossing tile boundaries, so P = 132 keeps every
SM busy with equal work. A tile's pieces are added in K order by whichever of its programs finishes last, so a
row's sum still depends on (N, K, P) only, never on M: such a plan would be batch-invariant, with other bits than
today's.

This script times that partition against the engine's launch and cuBLAS at M = 1, 8 and 16, for P = 120 (each
tile in three equal pieces: the engine's partition, the control), 132 and 264, and checks each against a float64
product. Nothing in the engine changes.

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/gemm_stream_k.py [--out PATH]
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
ROWS = (1, 8, 16)
# (block_n, block_m, block_k, warps, stages): the weight block is the swapped wgmma's M, the rows its N
TILE = (128, 16, 128, 8, 3)


def first_program(unit, programs: int, units: int):
    """The program whose run holds `unit`, when program p starts at floor(p * units / programs)."""
    return ((unit + 1) * programs - 1) // units


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def stream_k(
        x_desc, w_desc, out_ptr, part_ptr, count_ptr, M, N, so_m,
        K_BLOCKS: tl.constexpr, TILES: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        units = TILES * K_BLOCKS
        u = pid * units // PROGRAMS
        u_end = (pid + 1) * units // PROGRAMS
        rows = tl.arange(0, BLOCK_M).to(tl.int64)
        while u < u_end:
            tile = u // K_BLOCKS
            kb0 = u - tile * K_BLOCKS
            kb1 = tl.minimum(K_BLOCKS, kb0 + u_end - u)
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for kb in tl.range(kb0, kb1, num_stages=STAGES):
                w = w_desc.load([tile * BLOCK_N, kb * BLOCK_K])
                x = x_desc.load([0, kb * BLOCK_K])
                acc += tl.dot(w, tl.trans(x))
            piece_rows = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
            result = out_ptr + rows[:, None] * so_m
            ns = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < M) & (ns[None, :] < N)
            first = ((tile * K_BLOCKS + 1) * PROGRAMS - 1) // units  # `first_program`
            pieces = (((tile + 1) * K_BLOCKS) * PROGRAMS - 1) // units - first + 1
            if pieces == 1:
                tl.store(result + ns[None, :], piece_rows.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                plane = M.to(tl.int64) * N
                at = rows[:, None] * N + ns[None, :]
                tl.store(part_ptr + (pid - first) * plane + at, piece_rows, mask=mask)
                tl.debug_barrier()
                if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == pieces - 1:  # the last adds them in K order
                    total = tl.load(part_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
                    for piece in range(1, pieces):
                        total += tl.load(part_ptr + piece * plane + at, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(
                        out_ptr + rows[:, None] * so_m + ns[None, :], total.to(out_ptr.dtype.element_ty), mask=mask
                    )
                    tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")
            u += kb1 - kb0

    return stream_k


def most_pieces(tiles: int, k_blocks: int, programs: int) -> int:
    units = tiles * k_blocks
    return max(
        first_program((t + 1) * k_blocks - 1, programs, units) - first_program(t * k_blocks, programs, units) + 1
        for t in range(tiles)
    )


def launch(x: torch.Tensor, w: torch.Tensor, programs: int, counters: torch.Tensor, tile: tuple = TILE):
    """x @ w^T, its (tile, K block) units cut into `programs` equal runs; x holds at most one row tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, block_m, block_k, warps, stages = tile
    (m, k), n = x.shape, w.shape[0]
    assert m <= block_m and k % block_k == 0
    tiles, k_blocks = _cdiv(n, block_n), k // block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(most_pieces(tiles, k_blocks, programs), m, n, dtype=torch.float32, device=x.device)
    _kernel()[(programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
        out, part, counters, m, n, out.stride(0),
        K_BLOCKS=k_blocks, TILES=tiles, PROGRAMS=programs, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def shape_entry(n: int, k: int, programs: tuple[int, ...]) -> dict:
    copies = max(1, _cdiv(ROTATION_BYTES, n * k * 2))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(1 << 12, dtype=torch.int32, device="cuda")
    exact = (x.double() @ weights[0].double().T).float()
    entry = dict(n=n, k=k, cublas_us={}, engine_us={}, stream_k={})
    for m in ROWS:
        entry["cublas_us"][m] = graph_us(F.linear, x[:m], weights)
        entry["engine_us"][m] = graph_us(lambda a, w: linear.invariant_matmul_triton(a, w), x[:m], weights)
    for p in programs:

        def fn(a, w, p=p):
            return launch(a, w, p, counters)

        error = float((fn(x, weights[0]).float() - exact).abs().max())
        entry["stream_k"][p] = dict(us={m: graph_us(fn, x[:m], weights) for m in ROWS}, max_error=error)
    entry["engine_max_error"] = float((linear.invariant_matmul_triton(x, weights[0]).float() - exact).abs().max())
    del weights, x
    torch.cuda.empty_cache()
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sms=sms, tile=TILE, shapes={})
    for name, (n, k) in SHAPES.items():
        e = report["shapes"][name] = shape_entry(n, k, (_cdiv(n, TILE[0]) * 3, sms, 2 * sms))
        print(f"{name} {n}x{k}: us (x the engine); max |error| against float64: engine {e['engine_max_error']:.3g}")
        print(f"  {'':24}" + "".join(f"M={m:<14}" for m in ROWS))
        print(f"  {'cuBLAS':24}" + "".join(f"{e['cublas_us'][m]:<16.1f}" for m in ROWS))
        print(f"  {'engine':24}" + "".join(f"{e['engine_us'][m]:<16.1f}" for m in ROWS))
        for p, s in e["stream_k"].items():
            cells = "".join(f"{s['us'][m]:6.1f} ({s['us'][m] / e['engine_us'][m]:.2f})   " for m in ROWS)
            print(f"  {f'stream-K, {p} programs':24}{cells} error {s['max_error']:.3g}")
    report["seconds"] = round(time.time() - t0, 1)
    write_json(args.out, report)
    print(f"{report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
