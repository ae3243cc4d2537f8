"""What programmatic dependent launch (`triton_utils.launch`) costs and saves per kernel, on its own: a chain of
small dependent kernels (our swiglu kernel on one 17408-wide row, as in a 27B decode step), launched eagerly and
replayed from a CUDA graph, with and without PDL. Prints the host time per eager launch, the wall time per kernel
of each, and writes them as JSON (--out).

Usage (GPU box, repo root): python3 benchmarks/pdl_launch.py [--kernels 400] [--out report.json]
"""

import argparse
import json
import time

import torch

from qwen_mtp.ops import swiglu


def chain(kernel, buffers, kernels: int, pdl: bool) -> None:
    """`kernels` launches, each reading the previous one's output (so each depends on the one before)."""
    options = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    inter = buffers[0].shape[-1] // 2
    for i in range(kernels):
        src, dst = buffers[i % 2], buffers[(i + 1) % 2]
        kernel[(1, -(-inter // 1024))](src, dst, inter, BLOCK=1024, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=400)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kernel = swiglu._swiglu_kernel()
    inter = 17408
    # each output row [inter] is read as the next kernel's [inter // 2] gate_up row
    buffers = [torch.randn(1, inter, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    report = {"kernels": args.kernels, "device": torch.cuda.get_device_name()}
    for pdl in (False, True):
        name = "pdl" if pdl else "no_pdl"
        chain(kernel, buffers, 10, pdl)  # compile
        torch.cuda.synchronize()
        start = time.perf_counter()
        chain(kernel, buffers, args.kernels, pdl)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        eager = time.perf_counter() - start
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(kernel, buffers, args.kernels, pdl)
        graph.replay()
        torch.cuda.synchronize()
        replays = 20
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        graphed = (time.perf_counter() - start) / replays
        report[name] = {
            "eager_host_us_per_launch": 1e6 * host / args.kernels,
            "eager_us_per_kernel": 1e6 * eager / args.kernels,
            "graph_us_per_kernel": 1e6 * graphed / args.kernels,
        }
        print(name, {key: round(value, 2) for key, value in report[name].items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
