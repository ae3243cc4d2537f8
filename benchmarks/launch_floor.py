"""Is the intercept of the one-row GEMM line a cost every launch pays? (issue #14; `gemm_buckets.py`'s `one_row_line`)

The one-row launches of our GEMM over the 27B's shapes fit ~5.5 us plus their weights' bytes at the copy bandwidth,
where cuBLAS's line starts at 1-2 us (thirty-fourth session, H100). This script times, under a CUDA graph of
back-to-back launches as the dispatch table does:
- an empty Triton kernel of G programs (it only waits for the previous kernel and lets the next one launch, as ours
  do under programmatic dependent launch), G = 120 and 240 (the N = 5120 shapes' one-row grids) and 544;
- the engine's one-row launch of o_proj-shaped weights (N = 5120) at K = 128 .. 6144 with o_proj's plan, a line of
  one plan through K (K splits of 2048 columns: one split up to 2048, three at 6144);
- cuBLAS at the same shapes;
- the read floor: a kernel that only reads B bytes (and sums them) in one launch, for the 27B's W8A8 weight sizes
  (o_proj, in_proj, down, gate_up), the fastest of a few grids: what one launch of that many bytes can take at best,
  against which a one-row GEMM of the same bytes is measured; and the same reads started before the wait for the
  previous launch (only the sum's store waits): what the launch boundary itself costs a read.
Each with programmatic dependent launch on and off (`QWEN_MTP_PDL`, read at import: two processes).

Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/launch_floor.py [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn.functional as F
from gemm_buckets import one_row_line
from gemm_family import ROTATION_BYTES, _cdiv, graph_us, write_json

from qwen_mtp.ops import linear, triton_utils

GRIDS = (120, 240, 544)
N, KS = 5120, (128, 512, 2048, 4096, 6144)
READ_SHAPES = {"o_proj": (5120, 6144), "in_proj": (16384, 5120), "down": (5120, 17408), "gate_up": (34816, 5120)}
READ_GRIDS = (132, 264, 528, 1056)  # programs: 1, 2, 4, 8 a 132-SM GPU's SM


@functools.cache
def _empty_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def empty(out_ptr, PDL: tl.constexpr):
        triton_utils.wait_for_previous_kernel(PDL)
        if tl.program_id(0) == 0:
            tl.store(out_ptr, 1)

    return empty


@functools.cache
def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(src_ptr, out_ptr, per_program, n, CHUNK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr):
        # WAIT: src_ptr's reads wait for the previous kernel, as the GEMMs' activation reads do (the floor). Else
        # the next launch is let in at once and only the store waits: the reads overlap the previous launch, as a
        # weight read issued before the wait could (what the launch boundary costs; a bound on what that saves)
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * per_program
        end = tl.minimum(start + per_program, n)
        acc = tl.zeros([CHUNK], dtype=tl.int32)
        if WAIT:
            triton_utils.wait_for_previous_kernel(PDL)
        elif PDL:
            tl.extra.cuda.gdc_launch_dependents()
        for i in tl.range(start, end, CHUNK, num_stages=4):
            offs = i + tl.arange(0, CHUNK)
            acc += tl.load(src_ptr + offs, mask=offs < end, other=0)
        if PDL and not WAIT:
            tl.extra.cuda.gdc_wait()
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def read_launch(src: torch.Tensor, out: torch.Tensor, wait: bool = True) -> torch.Tensor:
    """Read every int32 of `src` once, in out.numel() programs of contiguous slices; each writes its sum. `wait`:
    the reads start after the previous kernel ends (else only the sum's store waits for it)."""
    programs, n = out.numel(), src.numel()
    chunk = 2048
    per_program = _cdiv(_cdiv(n, programs), chunk) * chunk
    _read_kernel()[(programs,)](src, out, per_program, n, CHUNK=chunk, WAIT=wait, **triton_utils.launch(src.device))
    return out


def read_times(sources: list[torch.Tensor], wait: bool = True) -> dict[int, float]:
    """us per launch reading one of `sources` (int32, rotated past L2 as the GEMMs' weights are), by grid size;
    `wait` as `read_launch` has it."""
    outs = {g: torch.zeros(g, dtype=torch.int32, device=sources[0].device) for g in READ_GRIDS}
    return {g: graph_us(lambda out, src: read_launch(src, out, wait), outs[g], sources) for g in READ_GRIDS}


def empty_launch(x: torch.Tensor, programs: torch.Tensor) -> torch.Tensor:
    """An empty kernel of `programs.numel()` programs (the graph helper's (x, weight) call shape; x is unused)."""
    _empty_kernel()[(programs.numel(),)](programs, **triton_utils.launch(programs.device))
    return programs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    report = dict(device=torch.cuda.get_device_name(), pdl=os.environ.get("QWEN_MTP_PDL", "1") != "0")
    x = torch.randn(1, max(KS), device="cuda", dtype=torch.bfloat16)
    flags = {g: torch.zeros(g, dtype=torch.int32, device="cuda") for g in GRIDS}
    report["empty_us"] = {g: graph_us(empty_launch, x, [flags[g]]) for g in GRIDS}
    report["engine_us"], report["cublas_us"] = {}, {}
    report["read_us"] = {}
    for name, (n, k) in READ_SHAPES.items():  # the W8A8 weights: one byte an element
        copies = max(1, _cdiv(ROTATION_BYTES, n * k))
        srcs = [torch.randint(0, 99, (n * k // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        times, early = read_times(srcs), read_times(srcs, wait=False)
        report["read_us"][name] = dict(mb=n * k / 1e6, us=times, best_tb_per_s=n * k / 1e6 / min(times.values()))
        report["read_us"][name] |= dict(reads_before_wait_us=early, best_us=min(times.values()))
        report["read_us"][name]["best_before_wait_us"] = min(early.values())
        del srcs
    plan = linear.row_plan(N, 6144, 1)  # o_proj's one-row plan at every K: the same tiles, splits of its columns
    report["plan"] = str(plan)
    for k in KS:
        copies = max(1, _cdiv(ROTATION_BYTES, N * k * 2))
        ws = [torch.randn(N, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        engine = functools.partial(linear.invariant_matmul_triton, plan=plan)
        report["engine_us"][k] = graph_us(engine, x[:, :k].contiguous(), ws)
        report["cublas_us"][k] = graph_us(F.linear, x[:, :k].contiguous(), ws)
        del ws
    shapes = {  # as `gemm_buckets.py --set dispatch` reports them, for its `one_row_line`
        f"K={k}": dict(n=N, k=k, dispatch=dict(us={1: report["engine_us"][k]}, cublas_us={1: report["cublas_us"][k]}))
        for k in KS
    }  # fmt: skip
    for key, times in (("engine", "us"), ("cublas", "cublas_us")):
        intercept, rate = one_row_line(shapes, times, weight_bytes=2)
        report[f"{key}_line"] = dict(intercept_us=intercept, tb_per_s=rate)
    pdl = "on" if report["pdl"] else "off"
    print(f"PDL {pdl}: empty kernel " + ", ".join(f"{g} programs {us:.2f} us" for g, us in report["empty_us"].items()))
    for name, r in report["read_us"].items():
        cells = " ".join(f"{g}:{us:.1f}" for g, us in r["us"].items())
        print(f"PDL {pdl}: read {name:8s} {r['mb']:6.1f} MB in one launch, us by programs {cells}")
        cells = " ".join(f"{g}:{us:.1f}" for g, us in r["reads_before_wait_us"].items())
        print(f"PDL {pdl}: read {name:8s} the same, reads before the wait: {cells}")
    for key in ("engine", "cublas"):
        line = report[f"{key}_line"]
        cells = " ".join(f"K={k}:{report[f'{key}_us'][k]:.1f}" for k in KS)
        fit = f"{line['intercept_us']:.2f} us + bytes at {line['tb_per_s']:.2f} TB/s"
        print(f"PDL {pdl}: {key:7s} N={N} {cells} -> {fit}")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
