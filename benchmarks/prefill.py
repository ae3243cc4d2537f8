"""GDN prefill on the GPU: our chunked Triton kernels (`qwen_mtp.ops.gdn_prefill`) against the plain-torch
chunked form (the baseline, what Hugging Face runs without flash-linear-attention), at Qwen3.5-27B GDN shapes
(16 key heads, 48 value heads, head dim 128), one request, bf16 inputs. Prints time per layer call, the ratio,
and the largest difference from the baseline; writes JSON to $OUT or cwd.
Usage (GPU box): python3 benchmarks/prefill.py [lengths ...]
"""

import json
import os
import sys

import torch
import triton

from qwen_mtp.ops.gdn import chunked_gated_delta_rule, gate_values
from qwen_mtp.ops.gdn_prefill import gdn_chunked_triton

HK, HV, DK, DV = 16, 48, 128, 128


def inputs(length: int):
    gen = torch.Generator(device="cuda").manual_seed(length)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    mixed = randn(1, length, 2 * HK * DK + HV * DV).to(torch.bfloat16)  # one conv output, sliced like the model
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(1, length, HK, DK), k.view(1, length, HK, DK), v.view(1, length, HV, DV)
    g, beta = gate_values(randn(1, length, HV), randn(1, length, HV).to(torch.bfloat16), randn(HV).abs(), randn(HV))
    return q, k, v, g, beta, randn(1, HV, DK, DV) * 0.1


def main() -> None:
    lengths = [int(x) for x in sys.argv[1:]] or [128, 512, 2048, 8192]
    rows, report = [], []
    for length in lengths:
        args = inputs(length)

        def run_ours(args=args):
            return gdn_chunked_triton(*args)

        def run_torch(args=args):
            return chunked_gated_delta_rule(*args[:5], initial_state=args[5])

        (ours, ours_state), (ref, ref_state) = run_ours(), run_torch()
        t_ours, t_ref = (triton.testing.do_bench(fn) * 1e3 for fn in (run_ours, run_torch))
        out_diff = (ours.float() - ref.float()).abs().max().item()
        state_diff = (ours_state - ref_state).abs().max().item()
        same = (ours == ref).float().mean().item()
        rows.append(
            f"T={length:5d}  ours {t_ours:9.1f} us  torch {t_ref:9.1f} us  speedup {t_ref / t_ours:6.1f}x  "
            f"max|out diff| {out_diff:.3g} (bf16 equal {100 * same:.1f}%)  max|state diff| {state_diff:.3g}"
        )
        report.append(dict(length=length, ours_us=t_ours, torch_us=t_ref, out_max_diff=out_diff,
                           out_equal_fraction=same, state_max_diff=state_diff))  # fmt: skip
        print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "prefill.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
