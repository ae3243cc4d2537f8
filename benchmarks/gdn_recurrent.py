"""The GDN decode / verify kernel (`gdn_recurrent_triton`) at Qwen3.5-27B shapes: how close it streams the state pool
to the copy bandwidth, and whether other program shapes would stream it faster.

A step reads each request's committed state (48 value heads x 128 x 128 fp32, 3.1 MB a layer) and writes one slot
per token (T = 1 for a decode, K + 1 for a verify), so at B32 a K=3 verify moves 24 GB over the 48 layers, against
9.7 GB for a plain step. Per (B, T): microseconds per layer call under a CUDA graph (pools bigger than L2, rows
rotated), GB/s of the bytes it must move, and that as a share of a device-to-device copy measured in the same run,
for the engine's shape (32 value columns a program, 4 warps) and others. Other shapes lay the dk sums out otherwise
(other rounding): timing only, the engine keeps one. Since the thirty-seventh session the kernel reads its state
before its programmatic-dependent-launch wait, so in this graph of back-to-back calls each call's state read
overlaps the call before it (other rows: no race); in a step the conv update runs before it instead, so these times
are a bound on a step's.

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/gdn_recurrent.py [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from qwen_mtp.bench import copy_bandwidth
from qwen_mtp.ops.gdn.recurrent import gdn_recurrent_triton

HK, HV, DK, DV = 16, 48, 128, 128
SHAPES = [(32, 4), (32, 8), (64, 4), (64, 8), (16, 4), (128, 8)]  # (value columns a program, warps); engine first


def graph_us(fn, reps: int = 20, calls: int = 1) -> float:
    """Microseconds per `fn(i)`, i = 0..calls-1 captured in one CUDA graph and replayed."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def copy_gbs() -> float:
    """The bench's copy bandwidth (an eager device-to-device copy, read + write), in GB/s. Not a copy captured in a
    graph: that becomes a memcpy node, which the H200 ran at 2.77 TB/s on copy engines against 4.25 eagerly."""
    return copy_bandwidth(torch.device("cuda")) / 1e9


def time_case(batch: int, length: int, copy: float, gen: torch.Generator) -> dict:
    """One (B, T): each program shape's microseconds and share of the copy bandwidth."""
    slots = max(length, 2)
    rows_total = max(batch, -(-(256 << 20) // (slots * HV * DK * DV * 4)))  # a pool past L2
    pool = torch.randn(rows_total, slots, HV, DK, DV, device="cuda", generator=gen) * 0.01
    q, k = (torch.randn(batch, length, HK, DK, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, length, HV, DV, device="cuda", dtype=torch.bfloat16)
    a, b = (torch.randn(batch, length, HV, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a_log, dt_bias = torch.randn(HV, device="cuda"), torch.randn(HV, device="cuda")
    committed = torch.zeros(rows_total, dtype=torch.int32, device="cuda")
    # each captured call on other pool rows, so no call finds its state in L2
    rotation = [torch.arange(batch, dtype=torch.int32, device="cuda") + i * batch for i in range(rows_total // batch)]
    moved = batch * HV * DK * DV * 4 * (1 + length)  # committed state read, a slot written per token
    cells = []
    for block_v, warps in SHAPES:
        launch = functools.partial(gdn_recurrent_triton, q, k, v, a, b, a_log, dt_bias, pool)
        call = functools.partial(lambda i, f, bv, w: f(rotation[i], committed, bv, w), f=launch, bv=block_v, w=warps)
        us = graph_us(call, calls=len(rotation))
        gbs = moved / us / 1e3
        cells.append(dict(block_v=block_v, warps=warps, us=us, gbs=gbs, of_copy=gbs / copy))
    return dict(batch=batch, tokens=length, moved_bytes=moved, shapes=cells)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy = copy_gbs()
    print(f"copy bandwidth {copy:.0f} GB/s")
    report = dict(copy_gbs=copy, rows=[])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, length in ((1, 1), (1, 4), (8, 1), (8, 4), (32, 1), (32, 4), (64, 1), (64, 4)):
        row = time_case(batch, length, copy, gen)
        report["rows"].append(row)
        cells = row["shapes"]
        line = "  ".join(f"v{c['block_v']}w{c['warps']} {c['us']:7.1f} us {100 * c['of_copy']:3.0f}%" for c in cells)
        print(f"B{batch:<3d} T{length}  {line}", flush=True)
        torch.cuda.empty_cache()
    path = args.out or os.path.join(os.environ.get("OUT", "."), "gdn_recurrent.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
