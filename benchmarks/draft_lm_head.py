"""The draft step's lm_head product on the GPU (`mtp.draft_lm_head`, docs/mtp.md): bf16 (the batch-invariant
GEMM the drafts run with `bf16`) against the FP8 copy (`DraftLmHead(fp8=True)`: W8A8, the default
`model.fp8_decode`, and W8A16), for the whole vocabulary and draft vocabularies, at the draft rows' M = 1 .. 32
(one row per request), under CUDA graphs; with the percent of the copy bandwidth (bytes: the weight, its scales,
the activations and logits). A K = 3 step runs this three times. The JSON report goes to --out (default:
$OUT/draft-lm-head.json).
Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/draft_lm_head.py [--hidden 5120] [--vocabs 248320,32768]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from gemm_family import graph_us

from qwen_mtp.bench import copy_bandwidth
from qwen_mtp.model.mtp import DraftLmHead
from qwen_mtp.ops.linear import linear

ROWS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=5120)  # 27B; 4096: 9B; 1024: 0.8B
    parser.add_argument("--vocabs", default="248320,65536,32768,30000")  # 30000: a partial last 128-row block
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "draft-lm-head.json"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = []
    for n in (int(v) for v in args.vocabs.split(",")):
        weight = torch.randn(n, args.hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * args.hidden**-0.5
        heads = {f"fp8 {kind}": DraftLmHead(weight, fp8=True, w8a8=kind == "w8a8") for kind in ("w8a8", "w8a16")}
        print(f"\nN={n} x {args.hidden}: bf16 {weight.numel() * 2 / 1e9:.2f} GB, fp8 copy "
              f"{heads['fp8 w8a8'].nbytes / 1e9:.2f} GB")  # fmt: skip
        for m in ROWS:
            x = torch.randn(m, args.hidden, device="cuda", dtype=torch.bfloat16)
            row = {"n": n, "k": args.hidden, "m": m}
            with torch.inference_mode():
                row["bf16_us"] = graph_us(lambda a, w: linear(a, w, True), x, [weight])
                for name, head in heads.items():
                    row[f"{name.replace(' ', '_')}_us"] = graph_us(lambda a, _, h=head: h.logits(a), x, [None])
            act = 2 * m * (n + args.hidden)
            row["bf16_pct_copy_bw"] = 100 * (2 * weight.numel() + act) / (row["bf16_us"] * 1e-6) / bandwidth
            fp8_bytes = heads["fp8 w8a8"].nbytes + act
            row["fp8_w8a8_pct_copy_bw"] = 100 * fp8_bytes / (row["fp8_w8a8_us"] * 1e-6) / bandwidth
            report.append(row)
            print(f"  M={m:<3d} bf16 {row['bf16_us']:7.1f} us ({row['bf16_pct_copy_bw']:3.0f}% bw)  fp8 w8a8 "
                  f"{row['fp8_w8a8_us']:7.1f} us ({row['fp8_w8a8_pct_copy_bw']:3.0f}% bw, "
                  f"{row['bf16_us'] / row['fp8_w8a8_us']:.2f}x)  fp8 w8a16 {row['fp8_w8a16_us']:7.1f} us")  # fmt: skip
        del weight, heads
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": report}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
