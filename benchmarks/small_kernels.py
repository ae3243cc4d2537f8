"""The decode step's small kernels at the 27B shapes, per launch choice, under CUDA graphs: the W8A8 activation
quantization (`quantize_activation_rows_triton`: rows per program, warps) at M = 1..128 and the GDN conv update
(`conv_update_triton`: channels per program, warps, tile or column kernel) at B = 1..32 and T = 1, 4. No choice
may change a number: every variant's bytes are compared with the default's, and a report lists the fastest variant
per case. Each case's outputs are also hashed, so two trees' reports show whether they compute the same bits.
Usage (GPU box): python3 benchmarks/small_kernels.py [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from qwen_mtp.ops import conv as conv_ops
from qwen_mtp.ops import linear as linear_ops

QUANTIZE_K = (5120, 6144, 17408)  # in_proj / qkv / gate_up, o_proj, down inputs at 27B
QUANTIZE_M = (1, 4, 32, 128)
QUANTIZE_VARIANTS = ((16, 4), (1, 1), (1, 2), (1, 4), (2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (16, 2), (32, 4))
CONV_CHANNELS, CONV_KERNEL, CONV_SPEC = 10240, 4, 3  # the 27B GDN conv: q, k, v channels; K = 3 windows
CONV_B, CONV_T = (1, 8, 32), (1, 4)
# (channels per program, warps, kernel): the tile kernel's default and next size, then the column kernel's choices
CONV_VARIANTS = (
    (128, 4, "tile"), (256, 4, "tile"), (128, 4, "columns"), (256, 2, "columns"), (256, 4, "columns"),
    (512, 2, "columns"), (512, 4, "columns"), (1024, 4, "columns"), (1024, 8, "columns"), (2048, 8, "columns"),
)  # fmt: skip


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def graphed_us(fn) -> float:
    import triton

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50)


def supported(fn, *args, **kwargs) -> bool:
    try:
        fn(*args, **kwargs)
        return True
    except TypeError:  # a tree whose launch takes no launch choices: its default only
        return False


def quantize_cases() -> list[dict]:
    rows = []
    for k in QUANTIZE_K:
        for m in QUANTIZE_M:
            x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(k + m)).bfloat16()
            default = linear_ops.quantize_activation_rows_triton(x)
            row = dict(kernel="quantize", k=k, m=m, bits=digest(*default), us={}, differs=[])
            tunable = supported(linear_ops.quantize_activation_rows_triton, x, 1, 1)
            for block, warps in QUANTIZE_VARIANTS if tunable else ((None, None),):
                args = (block, warps) if tunable else ()
                got = linear_ops.quantize_activation_rows_triton(x, *args)
                same = all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, default, strict=True)
                )
                label = f"rows{block} w{warps}" if tunable else "default"
                timed = graphed_us(lambda x=x, args=args: linear_ops.quantize_activation_rows_triton(x, *args))
                row["us"][label] = round(timed, 2)
                if not same:
                    row["differs"].append(label)
            rows.append(row)
    return rows


def conv_cases() -> list[dict]:
    rows = []
    window = CONV_KERNEL - 1 + CONV_SPEC
    for batch in CONV_B:
        for length in CONV_T:
            gen = torch.Generator("cuda").manual_seed(batch * 10 + length)
            fused = torch.randn(batch, length, 16480, device="cuda", generator=gen).bfloat16()
            x = fused[..., :CONV_CHANNELS]  # the fused in_proj's qkv slice, read in place as the engine does
            weight = torch.randn(CONV_CHANNELS, CONV_KERNEL, device="cuda", generator=gen).bfloat16()
            pool = torch.randn(batch + 3, CONV_CHANNELS, window, device="cuda", generator=gen).bfloat16()
            rows_ = torch.arange(batch, device="cuda") + 2
            committed = torch.randint(0, CONV_SPEC + 1, (batch + 3,), device="cuda", generator=gen)
            ref_pool = pool.clone()
            default = conv_ops.conv_update_triton(x, weight, ref_pool, rows_, committed)
            row = dict(kernel="conv", b=batch, t=length, bits=digest(default, ref_pool), us={}, differs=[])
            tunable = supported(conv_ops.conv_update_triton, x, weight, pool.clone(), rows_, committed, 128, 4, "tile")
            for block, warps, kind in CONV_VARIANTS if tunable else ((None, None, None),):
                args = (block, warps, kind) if tunable else ()
                trial = pool.clone()
                got = conv_ops.conv_update_triton(x, weight, trial, rows_, committed, *args)
                same = torch.equal(got, default) and torch.equal(trial, ref_pool)
                label = f"{kind} c{block} w{warps}" if tunable else "default"
                scratch = pool.clone()  # timed repeats rewrite the pool: time on a copy

                def run(args=args, scratch=scratch, x=x, weight=weight, rows_=rows_, committed=committed):
                    conv_ops.conv_update_triton(x, weight, scratch, rows_, committed, *args)

                row["us"][label] = round(graphed_us(run), 2)
                if not same:
                    row["differs"].append(label)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = dict(package=linear_ops.__file__, quantize=quantize_cases(), conv=conv_cases())
    for row in report["quantize"] + report["conv"]:
        case = f"M={row['m']:4d} K={row['k']:5d}" if row["kernel"] == "quantize" else f"B={row['b']:2d} T={row['t']}"
        best = min(row["us"], key=row["us"].get)
        first = next(iter(row["us"]))
        print(
            f"{row['kernel']:8s} {case}  {first} {row['us'][first]:6.2f} us  best {best} {row['us'][best]:6.2f} us"
            f"  bits {row['bits']}  differs {row['differs'] or '-'}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
