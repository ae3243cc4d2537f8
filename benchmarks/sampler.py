"""Micro-benchmark on the GPU: the filters' threshold (`filter_threshold_triton`, no sort: bf16 value counts of a
window of each row, or radix selects) against the sort the removed top-p path ran first
(`logits.float().sort(descending=True)`, before its scan kernel), and the sampler kernel itself for scale, at 1, 4,
32 and 128 rows (B32 K=3 verifies 128) of the real vocabulary, each timed as a replayed CUDA graph; and the
penalties (`apply_penalties_triton`) over the same rows as a K=3 verify lays them out (rows of 4 positions, 0..3
drafts counted before each). Checks the kernels against the reference on every shape, and reports how many tokens a
row's value counts held (the window).
Prints a table; writes sampler.json to $OUT or cwd. `--profile` prints each kernel's time instead (torch.profiler,
the counts method at the largest row count).

    python benchmarks/sampler.py [--rows 1 4 32 128] [--dtype bfloat16] [--radix-bits 4] [--block 2048] [--profile]
"""

import argparse
import json
import os

import torch
import triton

from qwen_mtp.ops import sampling as ops
from qwen_mtp.ops.penalties import apply_penalties_reference, apply_penalties_triton

VOCAB = 248_320


def inputs(rows: int, dtype: torch.dtype, top_k: bool):
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, VOCAB, generator=gen) * 3).to(dtype).cuda()
    inv_t = torch.full((rows,), 1 / 0.7, device="cuda")
    keep = torch.full((rows,), 50 if top_k else VOCAB, device="cuda")
    top_p = torch.full((rows,), 0.95, device="cuda")
    min_p = torch.full((rows,), float("-inf"), device="cuda")
    return logits, keep, inv_t, top_p, min_p


def graphed_us(fn) -> float:
    fn()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def measure(rows: int, top_k: bool, dtype: torch.dtype, block: int) -> dict:
    logits, keep, inv_t, top_p, min_p = inputs(rows, dtype, top_k)
    seed = torch.arange(rows, device="cuda")
    position = torch.full((rows,), 1000, device="cuda")
    expected = ops.filter_threshold_reference(logits, keep, inv_t, top_p, min_p)
    result = dict(
        rows=rows,
        filters="top-k 50 + top-p 0.95" if top_k else "top-p 0.95",
        kept=(logits.float() >= expected[:, None]).sum(dim=-1).float().mean().item(),
        sort_us=graphed_us(lambda: logits.float().sort(dim=-1, descending=True)),
        sampler_us=graphed_us(lambda: ops.sample_tokens_triton(logits, inv_t, expected, seed, position)),
    )
    if dtype == torch.bfloat16:
        row_max = logits.amax(dim=-1).float()
        counts, _, low, _ = ops._windowed_counts(logits, keep, inv_t, top_p, row_max, block)
        tops = ops.value_keys(row_max).tolist()  # a row's counts hold its values from `low` up to its largest
        lows = low.tolist()
        result["counted"] = sum(int(counts[r, lows[r] : top + 1].sum()) for r, top in enumerate(tops)) / rows
    for method in ("counts", "radix") if dtype == torch.bfloat16 else ("radix",):

        def threshold(method=method):
            return ops.filter_threshold_triton(logits, keep, inv_t, top_p, min_p, block=block, method=method)

        result[f"{method}_us"] = graphed_us(threshold)
        result[f"{method}_equals_reference"] = torch.equal(threshold(), expected)
    penalties = penalty_inputs(logits)
    result["penalties_us"] = graphed_us(lambda: apply_penalties_triton(*penalties))
    result["penalties_equal_reference"] = torch.equal(
        apply_penalties_triton(*penalties), apply_penalties_reference(*penalties)
    )
    return result


def penalty_inputs(logits: torch.Tensor) -> tuple:
    """Penalties over `logits` laid out as a K=3 verify's rows (request r // 4, position r % 4 with the r % 4 drafts
    before it), every request with all three penalties, a few hundred tokens counted, 20 biased, and two stop tokens
    banned at the first two positions (min_tokens)."""
    rows, gen = logits.shape[0], torch.Generator().manual_seed(7)
    requests = -(-rows // 4)
    counts = torch.zeros(requests, VOCAB, dtype=torch.int32)
    counts.scatter_add_(
        1, torch.randint(0, VOCAB, (requests, 300), generator=gen), torch.ones(requests, 300, dtype=torch.int32)
    )
    seen = torch.zeros(requests, VOCAB, dtype=torch.bool)
    seen.scatter_(1, torch.randint(0, VOCAB, (requests, 1000), generator=gen), True)
    bias = torch.zeros(requests, VOCAB)
    bias.scatter_(1, torch.randint(0, VOCAB, (requests, 20), generator=gen), 5.0)
    stops = torch.zeros(requests, VOCAB, dtype=torch.bool)
    stops[:, :2] = True
    state_rows = torch.arange(rows) // 4
    drafts = torch.randint(0, VOCAB, (rows, 3), generator=gen)
    drafts[torch.arange(3)[None, :] >= (torch.arange(rows) % 4)[:, None]] = -1
    positions = 1000 + torch.arange(rows) % 4
    values = (torch.full((rows,), 1.1), torch.full((rows,), 0.5), torch.full((rows,), 0.3), torch.full((rows,), 1002))
    parts = (counts, seen, bias, stops, state_rows, drafts, positions, *values)
    return (logits, *(t.cuda() for t in parts))


def profile(rows: int, block: int) -> None:
    """Each kernel's CUDA time in the counted threshold, top-p alone and top-k + top-p (eager, 20 calls each)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    for top_k in (False, True):
        logits, keep, inv_t, top_p, min_p = inputs(rows, torch.bfloat16, top_k)
        ops.filter_threshold_triton(logits, keep, inv_t, top_p, min_p, block=block, method="counts")
        torch.cuda.synchronize()
        with profiler(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                ops.filter_threshold_triton(logits, keep, inv_t, top_p, min_p, block=block, method="counts")
            torch.cuda.synchronize()
        print(f"R={rows} {'top-k 50 + top-p 0.95' if top_k else 'top-p 0.95'} (20 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--radix-bits", type=int, default=ops.RADIX_BITS, choices=[2, 4, 8])
    parser.add_argument("--block", type=int, default=ops.RADIX_BLOCK, help="tokens per program of a row (both methods)")
    parser.add_argument("--profile", action="store_true", help="each kernel's time (counts, largest row count)")
    args = parser.parse_args()
    ops.RADIX_BITS = args.radix_bits  # read at each call of filter_threshold_triton
    if args.profile:
        profile(max(args.rows), args.block)
        return
    report = []
    for rows in args.rows:
        for top_k in (False, True):
            r = measure(rows, top_k, getattr(torch, args.dtype), args.block)
            r.update(dtype=args.dtype, radix_bits=args.radix_bits, block=args.block)
            report.append(r)
            methods = "  ".join(
                f"{m} {r[f'{m}_us']:8.1f} us ({r['sort_us'] / r[f'{m}_us']:5.1f}x, exact: {r[f'{m}_equals_reference']})"
                for m in ("counts", "radix")
                if f"{m}_us" in r
            )
            print(
                f"R={rows:4d} {r['filters']:22s} {methods}  sort alone {r['sort_us']:8.1f} us"
                f"  sampler {r['sampler_us']:7.1f} us  penalties {r['penalties_us']:7.1f} us"
                f" (exact: {r['penalties_equal_reference']})  kept {r['kept']:8.0f} tokens"
                + (f", counted {r['counted']:8.0f}" if "counted" in r else ""),
                flush=True,
            )
    with open(os.path.join(os.environ.get("OUT", "."), "sampler.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
