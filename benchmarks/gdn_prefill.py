"""GDN prefill kernels at Qwen3.5-27B shapes (16 key / 48 value heads, head dim 128, bf16, one request, q/k/v
slices of one conv output as the model passes them): the WY/UT kernels of `qwen_mtp.ops.gdn.chunked` against the
kernels before them (`benchmarks/gdn_baseline.py`) and flash-linear-attention's `chunk_gated_delta_rule` when it
is importable, per prompt length. Prints ms per layer call, the split over the five kernels (profiler), the ratio
to the old kernels, the largest difference from the plain-torch reference, whether two runs and a packed call
(the sequence beside a shorter one, `gdn_chunked_varlen`) are bitwise equal; then a sweep of each kernel's launch
setting with the others at their defaults. JSON to $OUT/gdn-prefill.json (or ./gdn-prefill.json).
Usage (GPU box, repo root): PYTHONPATH=$PWD python3 benchmarks/gdn_prefill.py [lengths ...]   (default 2048 8192 32768;
SWEEP=0 skips the sweeps)
"""

import itertools
import json
import os
import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gdn_baseline  # noqa: E402

from qwen_mtp.ops.gdn import chunked, chunked_gated_delta_rule, gate_values  # noqa: E402

HK, HV, DK, DV = 16, 48, 128, 128
DEVICE = "cuda"
KERNELS = ("decay_kkt", "invert", "wy", "states", "output")
SWEEPS = {  # kernel -> {module constant: values}
    "states": {
        "STATE_BLOCK_V": (64, 128),  # 16 and 32 fault on the H200 (chunked.STATE_BLOCK_V)
        "STATE_WARPS": (4, 8),
        "STATE_STAGES": (1, 2),
    },
    "output": {"OUTPUT_BLOCK_V": (32, 64, 128), "OUTPUT_WARPS": (4, 8)},
    "prepare": {"PREPARE_WARPS": (4, 8), "INVERT_WARPS": (1, 2, 4)},
}


def inputs(length: int, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    mixed = randn(1, length, 2 * HK * DK + HV * DV).to(torch.bfloat16)
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(1, length, HK, DK), k.view(1, length, HK, DK), v.view(1, length, HV, DV)
    g, beta = gate_values(randn(1, length, HV), randn(1, length, HV).to(torch.bfloat16), randn(HV).abs(), randn(HV))
    return q, k, v, g, beta, randn(1, HV, DK, DV) * 0.1


def time_ms(fn, rep: int = 200) -> float:
    return triton.testing.do_bench(fn, rep=rep)


def kernel_split(fn) -> dict[str, float]:
    """Device ms per call of each Triton kernel that `fn` launches (by kernel name)."""
    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    names = KERNELS + ("prepare", "scan")  # ours, then the old kernels'
    return {e.key: e.self_device_time_total / 3e3 for e in prof.key_averages() if e.key in names}


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def fla_call():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None

    def call(q, k, v, g, beta, state):
        if HV != HK:
            q, k = (t.repeat_interleave(HV // HK, dim=2) for t in (q, k))
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=DK**-0.5, initial_state=state,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip

    return call


def packed_equal(length: int, args) -> bool:
    """The sequence packed after a shorter one gives bitwise its results alone."""
    q, k, v, g, beta, state = args
    other = inputs(length // 2 + 5, seed=1)
    packed = [torch.cat([o, x], dim=1) for o, x in zip(other[:5], (q, k, v, g, beta), strict=True)]
    cu = torch.tensor([0, length // 2 + 5, length // 2 + 5 + length], dtype=torch.int32, device=DEVICE)
    out, final = chunked.gdn_chunked_varlen_triton(*packed, cu, torch.cat([other[5], state]))
    alone, alone_final = chunked.gdn_chunked_triton(q, k, v, g, beta, state)
    return torch.equal(out[:, length // 2 + 5 :], alone) and torch.equal(final[1:], alone_final)


def sweep(args, new) -> dict:
    """Each kernel's settings in turn (the others at their defaults): ms of that kernel, the whole call's ms."""
    results = {}
    for part, space in SWEEPS.items():
        names = list(space)
        defaults = tuple(getattr(chunked, n) for n in names)
        rows = []
        for values in itertools.product(*(space[n] for n in names)):
            for n, value in zip(names, values, strict=True):
                setattr(chunked, n, value)
            try:
                out, final = new(*args)
                total = time_ms(lambda: new(*args), rep=100)
                split = kernel_split(lambda: new(*args))
            except Exception as err:  # a setting the compiler cannot build (e.g. shared memory)
                rows.append({"setting": dict(zip(names, values, strict=True)), "error": type(err).__name__})
                print(f"    {part} {values}: {type(err).__name__}")
                continue
            finally:
                for n, value in zip(names, defaults, strict=True):
                    setattr(chunked, n, value)
            kernels = ("decay_kkt", "invert", "wy") if part == "prepare" else (part,)
            ms = sum(split.get(name, 0.0) for name in kernels)
            same = torch.equal(out, new(*args)[0])
            rows.append({"setting": dict(zip(names, values, strict=True)), "kernel_ms": ms, "call_ms": total,
                         "same_output_as_default": same})  # fmt: skip
            mark = "*" if values == defaults else " "
            print(f"  {mark} {part:8s} {dict(zip(names, values, strict=True))}: {part} {ms:8.3f} ms, call {total:8.3f} "
                  f"ms, output == default's: {same}", flush=True)  # fmt: skip
        results[part] = rows
    return results


def measure(length: int, fla) -> dict:
    args = inputs(length)
    new, old = chunked.gdn_chunked_triton, gdn_baseline.gdn_chunked_triton
    ref_out, ref_final = chunked_gated_delta_rule(*args[:5], initial_state=args[5])
    out, final = new(*args)
    old_out, old_final = old(*args)
    row = {
        "new_ms": time_ms(lambda: new(*args)),
        "old_ms": time_ms(lambda: old(*args)),
        "new_kernels_ms": kernel_split(lambda: new(*args)),
        "old_kernels_ms": kernel_split(lambda: old(*args)),
        "new_vs_reference": {"out": max_diff(out, ref_out), "final": max_diff(final, ref_final)},
        "old_vs_reference": {"out": max_diff(old_out, ref_out), "final": max_diff(old_final, ref_final)},
        "deterministic": torch.equal(out, new(*args)[0]) and torch.equal(final, new(*args)[1]),
        "packed_equals_alone": packed_equal(length, args),
    }
    row["old_over_new"] = row["old_ms"] / row["new_ms"]
    split = "  ".join(f"{k} {v:.3f}" for k, v in row["new_kernels_ms"].items())
    print(f"{length} tokens: new {row['new_ms']:.3f} ms/layer ({split}), old {row['old_ms']:.3f} ms, "
          f"old/new {row['old_over_new']:.2f}x", flush=True)  # fmt: skip
    print(f"  max |diff| vs torch reference: new {row['new_vs_reference']}, old {row['old_vs_reference']}; "
          f"deterministic {row['deterministic']}, packed == alone {row['packed_equals_alone']}")  # fmt: skip
    if fla is not None:
        try:
            fla_out, fla_final = fla(*args)
            row["fla_ms"] = time_ms(lambda: fla(*args))
            row["fla_vs_reference"] = {"out": max_diff(fla_out, ref_out), "final": max_diff(fla_final, ref_final)}
            print(f"  fla {row['fla_ms']:.3f} ms (new / fla {row['new_ms'] / row['fla_ms']:.2f}), max |diff| vs "
                  f"torch reference {row['fla_vs_reference']}", flush=True)  # fmt: skip
        except Exception as err:  # e.g. an fla version that refuses these shapes
            row["fla_error"] = f"{type(err).__name__}: {err}"[:300]
            print(f"  fla: {row['fla_error']}")
    if os.environ.get("SWEEP", "1") != "0":
        row["sweep"] = sweep(args, new)
    return row


def main() -> None:
    lengths = [int(a) for a in sys.argv[1:]] or [2048, 8192, 32768]
    fla = fla_call()
    report = {"shapes": {"hk": HK, "hv": HV, "dk": DK, "dv": DV, "chunk": chunked.CHUNK}, "lengths": {}}
    for length in lengths:
        with torch.inference_mode():
            report["lengths"][str(length)] = measure(length, fla)
        torch.cuda.empty_cache()
    print("\n| tokens | new ms/layer | old ms/layer | old / new | fla ms/layer | best states | best output |")
    print("|---|---|---|---|---|---|---|")
    for length, row in report["lengths"].items():
        best = {part: min((r for r in rows if "kernel_ms" in r), key=lambda r: r["kernel_ms"], default=None)
                for part, rows in row.get("sweep", {}).items()}  # fmt: skip
        text = {part: f"{r['setting']} {r['kernel_ms']:.3f} ms" if r else "-" for part, r in best.items()}
        fla_ms = f"{row['fla_ms']:.3f}" if "fla_ms" in row else "-"
        print(f"| {length} | {row['new_ms']:.3f} | {row['old_ms']:.3f} | {row['old_over_new']:.1f}x | {fla_ms} | "
              f"{text.get('states', '-')} | {text.get('output', '-')} |")  # fmt: skip
    path = os.path.join(os.environ.get("OUT", "."), "gdn-prefill.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
