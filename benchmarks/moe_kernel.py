"""The fused-MoE kernels (`qwen_mtp::moe` on the decode path: route, align, gate/up + SwiGLU, down, combine)
against a loop over the touched experts of our dense batch-invariant GEMM (`invariant_matmul_triton`, gate/up
then down per expert, then the weighted sum), and against the grouped-GEMM reference that prefill runs, at the
expert shapes of Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B. Both decode-path variants are timed inside CUDA
graphs (the engine replays graphs); the roofline is the bytes of the experts the tokens touch over the measured
copy bandwidth. FP8 block experts (e4m3 + fp32 128x128 scales, W8A16) are timed beside bf16 on the same
routing, with their own roofline (1 byte a weight plus the scales), and checked bit for bit against the bf16
kernels on the dequantized experts. Prints a table; writes moe-kernel.json to $OUT (or the current directory).

    python benchmarks/moe_kernel.py [--tokens 1,8,32,128] [--prefill 512,2048]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from qwen_mtp.bench import copy_bandwidth
from qwen_mtp.ops.linear import dequantize_weight, invariant_matmul_triton
from qwen_mtp.ops.moe import moe_reference, moe_triton, route_triton
from qwen_mtp.ops.swiglu import swiglu
from qwen_mtp.quant.fp8 import quantize_fp8_block

SHAPES = {  # name -> (experts, top-k, hidden, expert intermediate)
    "qwen3.5-35b-a3b": (256, 8, 2048, 512),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512),
}


def per_expert_loop(x, gate_up, down, weights, ids, shared, gate):
    """The same function as a loop of dense GEMMs over the touched experts (the index lists come from the host
    once, outside the timed region, so the loop itself has no sync and can be graphed)."""
    top_k = ids.shape[1]
    flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
    groups = []
    for expert in flat_ids.unique().tolist():
        pairs = (flat_ids == expert).nonzero()[:, 0]
        groups.append((expert, pairs, pairs // top_k))

    def run():
        y = x.new_zeros(ids.numel(), x.shape[1])
        for expert, pairs, tokens in groups:
            h = swiglu(invariant_matmul_triton(x[tokens], gate_up[expert]))
            y[pairs] = invariant_matmul_triton(h, down[expert]) * flat_weights[pairs, None]
        routed = y.view(x.shape[0], top_k, -1).sum(1).to(x.dtype)
        return routed + torch.sigmoid(gate) * shared

    return run, len(groups)


def expert_weights(experts, hidden, inter, gen):
    """bf16 experts (gate_up [E, 2I, H], down [E, H, I]) and their FP8 block form ((e4m3, scales) per weight)."""
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5).bfloat16()

    def fp8(weight):
        pairs = [quantize_fp8_block(expert) for expert in weight]
        return torch.stack([q for q, _ in pairs]), torch.stack([scale for _, scale in pairs])

    return (gate_up, down), (fp8(gate_up), fp8(down))


def inputs(experts, top_k, hidden, tokens, gen):
    """Activations, routing and the shared expert's output of `tokens` tokens: (x, weights, ids, shared, gate)."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    x, logits = randn(tokens, hidden), randn(tokens, experts)
    weights, ids = route_triton(logits, top_k, True)
    return x, weights, ids, randn(tokens, hidden), randn(tokens, 1)


def bytes_of(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--prefill", default="512,2048")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    report, lines = [], [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s"]
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        (gate_up, down), ((gate_up_q, gate_up_s), (down_q, down_s)) = expert_weights(experts, hidden, inter, gen)
        expert_bytes = bytes_of(gate_up, down) // experts
        fp8_expert_bytes = bytes_of(gate_up_q, gate_up_s, down_q, down_s) // experts  # 1 byte a weight + scales
        dequantized = (dequantize_weight(gate_up_q, gate_up_s, torch.bfloat16),
                       dequantize_weight(down_q, down_s, torch.bfloat16))  # fmt: skip
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x, weights, ids, shared, gate = routed = inputs(experts, top_k, hidden, tokens, gen)
            data = (x, gate_up, down, weights, ids, shared, gate)
            fp8_data = (x, gate_up_q, down_q, *routed[1:], gate_up_s, down_s)
            loop, touched = per_expert_loop(*data)
            fused_us = triton.testing.do_bench_cudagraph(lambda data=data: moe_triton(*data)) * 1e3
            fp8_us = triton.testing.do_bench_cudagraph(lambda data=fp8_data: moe_triton(*data)) * 1e3
            loop_us = triton.testing.do_bench_cudagraph(loop) * 1e3
            roof_us = touched * expert_bytes / bandwidth * 1e6
            fp8_roof_us = touched * fp8_expert_bytes / bandwidth * 1e6
            fused = moe_triton(*data)
            error = (fused.float() - moe_reference(*data, invariant=True).float()).abs().max().item()
            alone = moe_triton(x[:1], gate_up, down, weights[:1], ids[:1], shared[:1], gate[:1])
            invariant = torch.equal(alone, fused[:1])
            fp8 = moe_triton(*fp8_data)
            fp8_exact = torch.equal(fp8, moe_triton(x, *dequantized, *routed[1:]))  # == bf16 on the dequantized
            fp8_alone = moe_triton(x[:1], gate_up_q, down_q, weights[:1], ids[:1], shared[:1], gate[:1],
                                   gate_up_s, down_s)  # fmt: skip
            fp8_invariant = torch.equal(fp8_alone, fp8[:1])
            lines.append(
                f"{name:20s} tokens {tokens:4d} experts hit {touched:3d}  fused {fused_us:8.1f} us  "
                f"loop {loop_us:8.1f} us  ({loop_us / fused_us:5.2f}x)  roofline {roof_us:7.1f} us "
                f"({100 * roof_us / fused_us:4.0f}%)  max|fused - ref| {error:.3g}  invariant {invariant}"
                f"\n{'':20s} {'':11s} {'FP8':>15s}  fused {fp8_us:8.1f} us  ({fused_us / fp8_us:5.2f}x bf16)  "
                f"roofline {fp8_roof_us:7.1f} us ({100 * fp8_roof_us / fp8_us:4.0f}%)  "
                f"== bf16 on dequantized {fp8_exact}  invariant {fp8_invariant}"
            )
            report.append(dict(model=name, path="decode", tokens=tokens, experts_touched=touched, fused_us=fused_us,
                               loop_us=loop_us, roofline_us=roof_us, max_error=error, invariant=invariant,
                               fp8_fused_us=fp8_us, fp8_roofline_us=fp8_roof_us, fp8_equals_dequantized=fp8_exact,
                               fp8_invariant=fp8_invariant))  # fmt: skip
        for tokens in [int(t) for t in args.prefill.split(",") if t]:
            x, weights, ids, shared, gate = routed = inputs(experts, top_k, hidden, tokens, gen)
            data = (x, gate_up, down, weights, ids, shared, gate)
            fp8_data = (x, gate_up_q, down_q, *routed[1:], gate_up_s, down_s)
            grouped_us = triton.testing.do_bench(lambda data=data: moe_reference(*data, invariant=False)) * 1e3
            fused_us = triton.testing.do_bench(lambda data=data: moe_triton(*data)) * 1e3
            # FP8 prefill: the reference dequantizes the touched experts, then the bf16 grouped GEMM
            fp8_grouped_us = (
                triton.testing.do_bench(lambda data=fp8_data: moe_reference(*data[:7], False, *data[7:])) * 1e3
            )
            fp8_fused_us = triton.testing.do_bench(lambda data=fp8_data: moe_triton(*data)) * 1e3
            lines.append(
                f"{name:20s} prefill {tokens:5d}  grouped GEMM (reference) {grouped_us:8.1f} us  "
                f"fused {fused_us:8.1f} us  ({grouped_us / fused_us:5.2f}x)  FP8: dequantize + grouped "
                f"{fp8_grouped_us:8.1f} us  fused {fp8_fused_us:8.1f} us"
            )
            report.append(dict(model=name, path="prefill", tokens=tokens, grouped_us=grouped_us, fused_us=fused_us,
                               fp8_grouped_us=fp8_grouped_us, fp8_fused_us=fp8_fused_us))  # fmt: skip
        del gate_up, down, gate_up_q, gate_up_s, down_q, down_s, dequantized
        torch.cuda.empty_cache()
    print("\n".join(lines))
    with open(os.path.join(os.environ.get("OUT", "."), "moe-kernel.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_tb_s": bandwidth / 1e12, "rows": report}, f,
                  indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
