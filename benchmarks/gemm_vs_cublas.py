"""Micro-benchmarks on the GPU: our batch-invariant Triton GEMM vs cuBLAS (`F.linear`) at decode shapes of
Qwen3.5-27B, and whether cuBLAS itself is batch-invariant there. Prints a table; writes JSON to $OUT or cwd."""

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from qwen_mtp.ops.linear import invariant_matmul_triton

SHAPES = {  # (N, K) of the 27B's linears
    "gdn in_proj_qkv": (10240, 5120), "gdn in_proj_z": (6144, 5120), "gdn out_proj": (5120, 6144),
    "attn q_proj": (12288, 5120), "mlp gate/up": (17408, 5120), "mlp down": (5120, 17408), "lm_head": (248320, 5120),
}  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    rows, report = [], []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in (1, 3, 8, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_ours = triton.testing.do_bench(lambda x=x, w=w: invariant_matmul_triton(x, w)) * 1e-3
            t_cublas = triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w)) * 1e-3
            gbs = w.numel() * 2 / t_ours / 1e9
            ours = invariant_matmul_triton(x, w)
            invariant = all(torch.equal(invariant_matmul_triton(x[i : i + 1], w), ours[i : i + 1]) for i in range(m))
            ref = F.linear(x, w)
            cublas_inv = all(torch.equal(F.linear(x[i : i + 1], w), ref[i : i + 1]) for i in range(m))
            err = (ours.float() - ref.float()).abs().max().item()
            rows.append(
                f"{name:16s} M={m:3d} ours {t_ours * 1e6:8.1f} us ({gbs:6.0f} GB/s)  cuBLAS {t_cublas * 1e6:8.1f} us"
                f"  ratio {t_ours / t_cublas:5.2f}  invariant: ours {invariant} cuBLAS {cublas_inv} max|diff| {err:.3g}"
            )
            report.append(dict(name=name, m=m, n=n, k=k, ours_us=t_ours * 1e6, cublas_us=t_cublas * 1e6,
                               ours_gb_s=gbs, ours_invariant=invariant, cublas_invariant=cublas_inv))  # fmt: skip
    print("\n".join(rows))
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "kernels.json"), "w") as f:
        json.dump(report, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
