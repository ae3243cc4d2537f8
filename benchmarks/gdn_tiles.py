"""GDN prefill kernels (`qwen_mtp.ops.gdn.chunked`) per launch setting, 27B shapes (16 key / 48 value heads,
head dim 128), one request: microseconds per call for each (scan value block, prepare warps, scan warps), split
into the `prepare` and `scan` kernels (profiler), with the outputs against the module's default setting.
Usage (GPU box): python3 benchmarks/gdn_tiles.py [tokens]
"""

import itertools
import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from qwen_mtp.ops.gdn import chunked

HK, HV, D = 16, 48, 128


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, length, HK, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, length, HV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = -torch.rand(1, length, HV, device="cuda", generator=gen) * 0.1
    beta = torch.rand(1, length, HV, device="cuda", generator=gen)
    base, base_state = chunked.gdn_chunked_triton(q, k, v, g, beta)
    default = (chunked.SCAN_BLOCK_V, chunked.PREPARE_WARPS, chunked.SCAN_WARPS)
    print(f"{length} tokens; default (scan block_v, prepare warps, scan warps) = {default}")
    for block_v, prep_warps, scan_warps in itertools.product((16, 32), (4, 8), (2, 4)):
        chunked.SCAN_BLOCK_V, chunked.PREPARE_WARPS, chunked.SCAN_WARPS = block_v, prep_warps, scan_warps
        try:
            out, state = chunked.gdn_chunked_triton(q, k, v, g, beta)
            us = triton.testing.do_bench(lambda: chunked.gdn_chunked_triton(q, k, v, g, beta), rep=200) * 1e3
        except Exception as err:  # a setting the compiler cannot build
            print(f"  block_v {block_v:3d} prep {prep_warps} scan {scan_warps}: {type(err).__name__}")
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                chunked.gdn_chunked_triton(q, k, v, g, beta)
            torch.cuda.synchronize()
        split = {e.key: e.self_device_time_total / 5 for e in prof.key_averages() if e.key in ("prepare", "scan")}
        diff = (out.float() - base.float()).abs().max().item()
        sdiff = (state - base_state).abs().max().item()
        mark = "*" if (block_v, prep_warps, scan_warps) == default else " "
        parts = "  ".join(f"{name} {t:8.1f}" for name, t in sorted(split.items()))
        print(f"{mark} block_v {block_v:3d} prep {prep_warps} scan {scan_warps}: {us:9.1f} us ({parts})  "
              f"out diff {diff:.2e} state diff {sdiff:.2e}", flush=True)  # fmt: skip
    chunked.SCAN_BLOCK_V, chunked.PREPARE_WARPS, chunked.SCAN_WARPS = default


if __name__ == "__main__":
    main()
