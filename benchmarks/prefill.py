"""Prefill kernels on the GPU against their baselines, same run, Qwen3.5-27B shapes, one request, bf16:
- GDN: our chunked Triton kernels (`qwen_mtp.ops.gdn.chunked`) vs the plain-torch chunked form (what Hugging
  Face runs without flash-linear-attention); 16 key / 48 value heads, head dim 128; T = whole prompt.
- attention: the tiled paged kernel (`qwen_mtp.ops.prefill_attention`) vs gathering the pages + SDPA (the
  CPU path, and the CUDA path before the kernel); 24 query / 4 KV heads, head dim 256, pages of 64; the last
  512-token chunk of a T-token prompt. Each (pairs per program, keys per block, warps, stages) tile is timed;
  the engine's fixed tile is marked *.
- `--long CHUNK:CONTEXT ...`: the attention alone, a CHUNK-token chunk ending a CONTEXT-token prompt (the shape
  that dominates a long prompt's attention time), over the wider tile sweep `LONG_TILES`, in TFLOP/s of the
  causal work, against SDPA's flash kernel on contiguous keys (GQA heads expanded, bottom-right causal mask):
  the best dense kernel torch ships, without our paging or invariance.
Prints time per layer call, the ratio, and the difference from the baseline; writes JSON to $OUT or cwd.
Usage (GPU box): python3 benchmarks/prefill.py [lengths ...] [--long 8192:32768 8192:8192]
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from qwen_mtp.ops import prefill_attention
from qwen_mtp.ops.gdn import chunked_gated_delta_rule, gate_values
from qwen_mtp.ops.gdn.chunked import gdn_chunked_triton
from qwen_mtp.ops.prefill_attention import prefill_attention_reference, prefill_attention_triton

HK, HV, DK, DV = 16, 48, 128, 128
HEADS, KV_HEADS, HEAD_DIM, PAGE, CHUNK = 24, 4, 256, 64, 512
TILES = [(64, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (32, 64, 4, 2)]
LONG_TILES = [
    (128, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 128, 8, 1),
    (128, 128, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 2),
]  # fmt: skip
ENGINE_TILE = (prefill_attention.ROWS, prefill_attention.BLOCK_N, prefill_attention.WARPS, prefill_attention.STAGES)


def inputs(length: int):
    gen = torch.Generator(device="cuda").manual_seed(length)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    mixed = randn(1, length, 2 * HK * DK + HV * DV).to(torch.bfloat16)  # one conv output, sliced like the model
    q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(1, length, HK, DK), k.view(1, length, HK, DK), v.view(1, length, HV, DV)
    g, beta = gate_values(randn(1, length, HV), randn(1, length, HV).to(torch.bfloat16), randn(HV).abs(), randn(HV))
    return q, k, v, g, beta, randn(1, HV, DK, DV) * 0.1


def paged_chunk(chunk: int, context: int):
    """Queries of the last `chunk` positions of a `context`-token prompt and its KV on shuffled pages:
    (q [1, chunk, H, D], kv, tables [1, pages], lens [1], scale)."""
    gen = torch.Generator(device="cuda").manual_seed(context)
    pages = -(-context // PAGE)
    tables = torch.randperm(pages, device="cuda", generator=gen).int()[None]
    kv = torch.randn(2, pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    q = torch.randn(1, chunk, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    return q, kv, tables, torch.tensor([context], device="cuda", dtype=torch.int32), HEAD_DIM**-0.5


def attention(length: int) -> list[dict]:
    """The last chunk (<= 512 tokens) of a `length`-token prompt over shuffled pages."""
    chunk = min(CHUNK, length)
    q, kv, tables, lens, scale = paged_chunk(chunk, length)
    ref = prefill_attention_reference(q, kv, tables, lens, scale)
    t_ref = triton.testing.do_bench(lambda: prefill_attention_reference(q, kv, tables, lens, scale)) * 1e3
    report = []
    for tile in TILES:
        ours = prefill_attention_triton(q, kv, tables, lens, scale, *tile)
        t_ours = triton.testing.do_bench(lambda tile=tile: prefill_attention_triton(q, kv, tables, lens, scale, *tile))
        t_ours *= 1e3
        diff, same = (ours.float() - ref.float()).abs().max().item(), (ours == ref).float().mean().item()
        mark = "*" if tile == ENGINE_TILE else " "
        print(
            f"attention T={length:5d} chunk {chunk:3d} tile {tile}{mark} ours {t_ours:8.1f} us  gather+SDPA "
            f"{t_ref:8.1f} us  speedup {t_ref / t_ours:5.2f}x  max|diff| {diff:.3g} (bf16 equal {100 * same:.1f}%)",
            flush=True,
        )
        report.append(dict(kind="attention", length=length, chunk=chunk, tile=tile, ours_us=t_ours, sdpa_us=t_ref,
                           max_diff=diff, equal_fraction=same))  # fmt: skip
    return report


def causal_flops(chunk: int, context: int) -> float:
    """FLOPs of a chunk's attention (two products of head size, per visible (query, key) pair, per query head)."""
    pairs = chunk * (context - chunk) + chunk * (chunk + 1) / 2
    return 4 * HEADS * HEAD_DIM * pairs


def sdpa_flash_us(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> float | None:
    """SDPA's flash kernel on the same chunk: q [1, T, H, D] over contiguous keys/values [1, S, KV, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = HEADS // KV_HEADS
    qh = q.transpose(1, 2).contiguous()
    kh, vh = (x.transpose(1, 2).repeat_interleave(group, dim=1).contiguous() for x in (keys, values))
    mask = causal_lower_right(q.shape[1], keys.shape[1])
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, mask, scale=scale)) * 1e3
    except RuntimeError as error:  # the flash backend refused the shape or the mask
        print(f"  SDPA flash: {str(error).splitlines()[0]}")
        return None


def long_attention(chunk: int, context: int) -> list[dict]:
    """The last `chunk` positions of a `context`-token prompt over shuffled pages, every tile of `LONG_TILES`."""
    q, kv, tables, lens, scale = paged_chunk(chunk, context)
    keys, values = (kv[half][tables[0].long()].flatten(0, 1)[None, :context] for half in (0, 1))
    flops = causal_flops(chunk, context)
    t_flash = sdpa_flash_us(q, keys, values, scale)
    flash = f"{t_flash:9.1f} us ({flops / t_flash / 1e6:5.1f} TFLOP/s)" if t_flash else "-"
    print(f"attention chunk {chunk} of context {context}: {flops / 1e12:.2f} TFLOP a layer; SDPA flash {flash}")
    ref = prefill_attention_reference(q[:, -256:], kv, tables, lens, scale)  # the last 256 queries (memory)
    report = []
    for tile in LONG_TILES:
        try:
            ours = prefill_attention_triton(q, kv, tables, lens, scale, *tile)
        except Exception as error:  # e.g. a tile past the shared memory: the sweep goes on
            print(f"  tile {tile}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        t_ours = triton.testing.do_bench(lambda tile=tile: prefill_attention_triton(q, kv, tables, lens, scale, *tile))
        t_ours *= 1e3
        diff = (ours[:, -256:].float() - ref.float()).abs().max().item()
        mark = "*" if tile == ENGINE_TILE else " "
        ratio = f"{t_flash / t_ours:5.2f}x flash" if t_flash else ""
        print(f"  tile {tile}{mark} {t_ours:9.1f} us  {flops / t_ours / 1e6:5.1f} TFLOP/s  {ratio}  "
              f"max|diff| (last 256 rows) {diff:.3g}", flush=True)  # fmt: skip
        report.append(dict(kind="long_attention", chunk=chunk, context=context, tile=tile, ours_us=t_ours,
                           flash_us=t_flash, tflops=flops / t_ours / 1e6, max_diff=diff))  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lengths", type=int, nargs="*", default=[128, 512, 2048, 8192])
    parser.add_argument("--long", nargs="+", default=[], metavar="CHUNK:CONTEXT")
    args = parser.parse_args()
    rows, report = [], []
    if args.long:
        for shape in args.long:
            chunk, context = (int(x) for x in shape.split(":"))
            report += long_attention(chunk, context)
        with open(os.path.join(os.environ.get("OUT", "."), "prefill-long.json"), "w") as f:
            json.dump(report, f, indent=2)
        return
    lengths = args.lengths
    for length in lengths:
        report += attention(length)
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
            f"GDN T={length:5d}  ours {t_ours:9.1f} us  torch {t_ref:9.1f} us  speedup {t_ref / t_ours:6.1f}x  "
            f"max|out diff| {out_diff:.3g} (bf16 equal {100 * same:.1f}%)  max|state diff| {state_diff:.3g}"
        )
        report.append(dict(kind="gdn", length=length, ours_us=t_ours, torch_us=t_ref, out_max_diff=out_diff,
                           out_equal_fraction=same, state_max_diff=state_diff))  # fmt: skip
        print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "prefill.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
