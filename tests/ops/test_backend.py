"""The ops are registered with the engine, run their references on CPU, and their CUDA implementations run the
references instead of the Triton kernels while `reference_ops()` / `QWEN_MTP_OPS=reference` force them.

Without a GPU the CUDA implementations are reached through the dispatcher with CPU tensors (a redispatch to the
CUDA key); their Triton kernels then run under the interpreter, so a spy on each kernel's launcher tells which
path ran."""

import pytest
import torch
from op_helpers import DEVICE, fused_projection, paged_setup, rand, strided_attention_step

import qwen_mtp.engine.runner  # noqa: F401  (registers the ops)
from qwen_mtp.ops import (
    backend,
    conv,
    linear,
    moe,
    norm,
    output_gate,
    paged_attention,
    penalties,
    rope,
    sampling,
    swiglu,
)
from qwen_mtp.ops.backend import reference_ops
from qwen_mtp.ops.gdn import chunked, gates, recurrent


def norm_args(extra: int):
    return (rand(2, 3, 8), *(rand(2, 3, 8, seed=1 + i) for i in range(extra)), rand(8, seed=5, scale=0.1), 1e-6)


def rope_args():
    q_gate, k_proj = fused_projection(2, 3, [2 * 4 * 16, 2 * 16])
    q, k = q_gate.reshape(2, 3, 4, 32)[..., :16], k_proj.reshape(2, 3, 2, 16)
    return (q, k, rand(16, scale=0.1), rand(16, seed=1, scale=0.1), 1e-6, rand(2, 3, 8, seed=9), rand(2, 3, 8, seed=10))


def conv_args():
    rows, committed = torch.tensor([4, 0, 2], device=DEVICE), torch.tensor([1, 0, 3, 0, 2], device=DEVICE)
    return (rand(3, 2, 40, seed=2), rand(40, 4, seed=3), rand(5, 40, 7, seed=1), rows, committed)


def conv_varlen_args():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    return (fused_projection(1, 7, [8, 40])[1], rand(40, 4, seed=3), cu, [None, rand(1, 40, 3, seed=4)])


def gates_varlen_args():
    cu = torch.tensor([0, 2, 9], dtype=torch.int32, device=DEVICE)
    return (rand(1, 9, 4, seed=1), rand(1, 9, 4, seed=2), rand(4, seed=3).abs(), rand(4, seed=4), cu)


def gdn_recurrent_args():
    q, k, v = (t.view(3, 2, -1, 16) for t in fused_projection(3, 2, [32, 32, 64], seed=1))
    a, b = rand(3, 2, 4, seed=4), rand(3, 2, 4, seed=5)
    pool = rand(6, 6, 4, 16, 16, seed=8, scale=0.1)
    rows, committed = torch.tensor([5, 1, 3], device=DEVICE), torch.tensor([0, 2, 0, 4, 0, 1], device=DEVICE)
    return (q, k, v, a, b, rand(4, seed=6).abs(), rand(4, seed=7).abs(), pool, rows, committed)


def gdn_chunked_args():
    q, k, v = (t.view(1, 5, -1, 16) for t in fused_projection(1, 5, [32, 32, 64], seed=11))
    return (q, k, v, -rand(1, 5, 4, seed=12).abs(), rand(1, 5, 4, seed=13).sigmoid(), rand(1, 4, 16, 16, seed=14))


def gdn_chunked_varlen_args():
    q, k, v = (t.view(1, 7, -1, 16) for t in fused_projection(1, 7, [32, 32, 64], seed=11))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    return (q, k, v, -rand(1, 7, 4, seed=12).abs(), rand(1, 7, 4, seed=13).sigmoid(), cu, rand(2, 4, 16, 16, seed=14))


def moe_args():
    x, ids = rand(3, 16), torch.tensor([[1, 3], [3, 0], [2, 1]], device=DEVICE)
    experts = (rand(4, 16, 16, seed=1), rand(4, 16, 8, seed=2))
    return (x, *experts, rand(3, 2, seed=3).softmax(-1), ids, rand(3, 16, seed=4), rand(3, 1, seed=5), True)


def sample_args():
    seed, position = torch.tensor([3, 2**40, 7], device=DEVICE), torch.tensor([0, 9, 4000], device=DEVICE)
    inv_t, threshold = torch.tensor([0.0, 1.5, 0.8], device=DEVICE), torch.tensor([-9.0, 0.0, -1.0], device=DEVICE)
    return (rand(3, 100, seed=15), inv_t, threshold, seed, position)


def penalty_args():
    counts = torch.randint(0, 3, (2, 100), generator=torch.Generator().manual_seed(17), dtype=torch.int32)
    seen, rows = counts.flip(1) > 1, torch.tensor([1, 0, 1])
    bias, stops = torch.where(counts == 2, 2.5, 0.0), counts == 1
    drafts, rep = torch.tensor([[-1, -1], [5, -1], [5, 9]]), torch.tensor([1.3, 1.0, 0.8])
    freq, pres = torch.tensor([0.5, 0.0, -1.0]), torch.tensor([1.0, 0.0, 0.2])
    positions, min_end = torch.tensor([4, 9, 12]), torch.tensor([0, 10, 12])
    parts = (counts, seen, bias, stops, rows, drafts, positions, rep, freq, pres, min_end)
    return (rand(3, 100, seed=18), *(t.to(DEVICE) for t in parts))


def filter_args():
    keep, inv_t = torch.tensor([100, 10, 1], device=DEVICE), torch.tensor([1.0, 2.0, 0.5], device=DEVICE)
    top_p, min_p = (
        torch.tensor([0.9, 0.5, 0.99], device=DEVICE),
        torch.tensor([-2.0, float("-inf"), -1.0], device=DEVICE),
    )
    return (rand(3, 100, seed=16), keep, inv_t, top_p, min_p)


def fp8_weight(n, k):
    from qwen_mtp.quant.fp8 import quantize_fp8_block

    return tuple(t.to(DEVICE) for t in quantize_fp8_block(rand(n, k).cpu()))


# op -> (module, its Triton launcher that the CUDA implementation calls, fresh arguments)
CUDA_PATHS = {
    "rms_norm": (norm, "norm_triton", lambda: norm_args(0)),
    "gated_rms_norm": (norm, "norm_triton", lambda: norm_args(1)),
    "add_rms_norm": (norm, "norm_triton", lambda: norm_args(1)),
    "swiglu": (swiglu, "swiglu_triton", lambda: (rand(2, 3, 16),)),
    "norm_w8a8": (norm, "norm_triton", lambda: (rand(2, 3, 256), rand(256, seed=2, scale=0.1), 1e-6)),
    "swiglu_w8a8": (swiglu, "swiglu_triton", lambda: (rand(2, 3, 512), True)),
    "output_gate": (output_gate, "output_gate_triton", lambda: (rand(2, 2, 3, 16).transpose(1, 2), rand(2, 3, 2, 16))),
    "output_gate_w8a8": (output_gate, "output_gate_triton", lambda: (rand(2, 3, 2, 128), rand(2, 3, 2, 128), True)),
    "qk_norm_rope": (rope, "qk_norm_rope_triton", rope_args),
    "conv_update": (conv, "conv_update_triton", conv_args),
    "conv_prefill": (
        conv,
        "conv_prefill_triton",
        lambda: (fused_projection(2, 5, [8, 40])[1], rand(40, 4, seed=3), rand(2, 40, 3, seed=4)),
    ),
    "conv_prefill_varlen": (conv, "conv_prefill_varlen_triton", conv_varlen_args),
    "gate_values_varlen": (gates, "gate_values_at_once", gates_varlen_args),
    "gdn_recurrent": (recurrent, "gdn_recurrent_triton", gdn_recurrent_args),
    "gdn_chunked": (chunked, "gdn_chunked_triton", gdn_chunked_args),
    "gdn_chunked_varlen": (chunked, "gdn_chunked_varlen_triton", gdn_chunked_varlen_args),
    "paged_attention": (paged_attention, "write_kv_triton", strided_attention_step),
    "paged_prefill_attention": (paged_attention, "write_kv_triton", strided_attention_step),
    "linear": (linear, "invariant_matmul_triton", lambda: (rand(2, 3, 16), rand(5, 16), True)),
    "moe": (moe, "moe_triton", moe_args),
    "moe_route": (moe, "route_triton", lambda: (rand(3, 6), 2, True)),
    "sample_tokens": (sampling, "sample_tokens_triton", sample_args),
    "apply_penalties": (penalties, "apply_penalties_triton", penalty_args),
    "filter_threshold": (sampling, "filter_threshold_triton", filter_args),
    "linear_fp8": (linear, "invariant_matmul_triton", lambda: (rand(2, 3, 16), *fp8_weight(5, 16), True)),
}


def on_key(key, name, args):
    """Run op `name`'s implementation for dispatch key `key` (CPU: its reference) on `args`, devices aside."""
    return getattr(torch.ops.qwen_mtp, name).default.redispatch(torch._C.DispatchKeySet(key), *args)


def assert_same_results(ours, ours_args, expected, expected_args):
    outputs = ours if isinstance(ours, tuple) else (ours,)
    for mine, theirs in zip(outputs, expected if isinstance(expected, tuple) else (expected,), strict=True):
        assert mine.is_contiguous() and torch.equal(mine, theirs)
    for mine, theirs in zip(ours_args, expected_args, strict=True):  # pools and caches written the same way
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", sorted(CUDA_PATHS))
def test_cuda_implementation_runs_the_reference_while_forced(name, monkeypatch):
    module, launcher, make_args = CUDA_PATHS[name]
    launches = []
    triton_launcher = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **kw: launches.append(a) or triton_launcher(*a, **kw))
    cuda, cpu = torch._C.DispatchKey.CUDA, torch._C.DispatchKey.CPU
    reference_args = make_args()
    reference = on_key(cpu, name, reference_args)
    for forced in ((name,), ()):  # this op alone, then every op
        args = make_args()
        with reference_ops(*forced):
            assert backend.reference_forced(name)
            result = on_key(cuda, name, args)
        assert not launches, f"{name}: a Triton kernel ran while its reference was forced"
        assert_same_results(result, args, reference, reference_args)
    other = next(op for op in sorted(backend.OPS) if op != name)
    with reference_ops(other):
        on_key(cuda, name, make_args())
    assert launches, f"{name}: forcing {other} alone also kept {name}'s Triton kernel from running"


def test_reference_ops_nests_and_restores():
    assert not backend.reference_forced("gdn_chunked")
    with reference_ops("gdn_chunked"):
        assert backend.reference_forced("gdn_chunked") and not backend.reference_forced("rms_norm")
        assert not backend.reference_forced()  # not every op
        with reference_ops():
            assert backend.reference_forced() and backend.reference_forced("rms_norm")
        assert not backend.reference_forced("rms_norm")
    assert not backend.reference_forced("gdn_chunked")


def test_reference_ops_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown ops \\['gdn_chunk'\\]"):
        with reference_ops("gdn_chunk"):
            pass


@pytest.mark.parametrize("value,forced", [("", frozenset()), ("reference", backend.OPS), (" Reference ", backend.OPS)])
def test_environment_forces_every_reference(value, forced, monkeypatch):
    monkeypatch.setenv("QWEN_MTP_OPS", value)
    assert backend._forced_by_environment() == forced


def test_environment_refuses_other_values(monkeypatch):
    monkeypatch.setenv("QWEN_MTP_OPS", "refrence")
    with pytest.raises(ValueError, match="QWEN_MTP_OPS='refrence': set it to 'reference'"):
        backend._forced_by_environment()


def test_every_registered_op_can_be_forced():
    ops = torch.ops.qwen_mtp
    registered = {name for name in dir(ops) if isinstance(getattr(ops, name), torch._ops.OpOverloadPacket)}
    assert registered == backend.OPS
    assert set(CUDA_PATHS) == backend.OPS


def test_custom_ops_registered_and_dispatch_to_reference_on_cpu():
    q, kv, tables, lens = paged_setup(1, torch.float32)
    k, v = rand(3, 1, 2, 32, seed=3), rand(3, 1, 2, 32, seed=4)
    positions = lens[:, None].long() - 1
    for op in ("paged_attention", "conv_update", "gdn_recurrent"):
        assert hasattr(torch.ops.qwen_mtp, op)
    torch.library.opcheck(
        torch.ops.qwen_mtp.paged_attention.default, (q, k, v, kv.clone(), tables, lens, positions, 0.1)
    )


def test_packed_gates_run_per_sequence_on_cpu_and_at_once_on_cuda():
    """`gate_values_varlen`: on CPU each sequence's gates as `gate_values` alone, bit for bit; the CUDA
    implementation (run here on CPU tensors) is `gate_values` over the packed tensor. That it equals each sequence
    alone on the GPU is tests/gpu/test_mixed_steps_cuda.py's packed == alone."""
    from qwen_mtp.ops.gdn import gate_values

    a, b = rand(1, 9, 4, seed=1), rand(1, 9, 4, seed=2, dtype=torch.bfloat16)
    a_log, dt_bias = rand(4, seed=3).abs(), rand(4, seed=4)
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    args = (a, b, a_log, dt_bias, cu)
    per_sequence = [gate_values(a[:, i:j], b[:, i:j], a_log, dt_bias) for i, j in ((0, 2), (2, 9))]
    for mine, theirs in zip(on_key(torch._C.DispatchKey.CPU, "gate_values_varlen", args),
                            zip(*per_sequence, strict=True), strict=True):  # fmt: skip
        assert torch.equal(mine, torch.cat(theirs, dim=1))
    at_once = gate_values(a, b, a_log, dt_bias)
    for mine, theirs in zip(on_key(torch._C.DispatchKey.CUDA, "gate_values_varlen", args), at_once, strict=True):
        assert torch.equal(mine, theirs)
