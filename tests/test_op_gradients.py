"""Backward through each fused op is backward through its plain-torch reference (`ops/autograd.py`): the model
has one differentiable path, so training runs the layer code inference runs."""

import pytest
import torch


def _rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _fused_op_cases():
    from qwen_mtp.ops.gdn import chunked_gated_delta_rule
    from qwen_mtp.ops.gdn.chunked import gdn_chunked
    from qwen_mtp.ops.norm import add_rms_norm, add_rms_norm_reference
    from qwen_mtp.ops.output_gate import output_gate, output_gate_reference
    from qwen_mtp.ops.rope import qk_norm_rope, qk_norm_rope_reference
    from qwen_mtp.ops.swiglu import swiglu, swiglu_reference

    x = _rand(2, 3, 16, seed=1)[..., :8]
    q, k = _rand(2, 3, 4, 8, seed=2), _rand(2, 3, 2, 8, seed=3)
    cos, sin = _rand(2, 3, 4, seed=4), _rand(2, 3, 4, seed=5)
    gq, gk, gv = _rand(1, 5, 2, 8, seed=6), _rand(1, 5, 2, 8, seed=7), _rand(1, 5, 4, 8, seed=8)
    decay, beta = -_rand(1, 5, 4, seed=9).abs(), _rand(1, 5, 4, seed=10).sigmoid()
    initial = _rand(1, 4, 8, 8, seed=11, scale=0.1)
    head_norms = (_rand(8, seed=15), _rand(8, seed=16))
    attention_out = _rand(2, 4, 3, 8, seed=18).transpose(1, 2)  # [B, H, T, D] as [B, T, H, D]

    def gdn_reference(q, k, v, g, b, state):
        return chunked_gated_delta_rule(q, k, v, g, b, initial_state=state)

    return {
        "add_rms_norm": (add_rms_norm, add_rms_norm_reference, (x, _rand(2, 3, 8, seed=12), _rand(8, seed=13), 1e-6)),
        "swiglu": (swiglu, swiglu_reference, (_rand(2, 3, 16, seed=14),)),
        "output_gate": (output_gate, output_gate_reference, (attention_out, _rand(2, 3, 4, 16, seed=17)[..., 8:])),
        "qk_norm_rope": (qk_norm_rope, qk_norm_rope_reference, (q, k, *head_norms, 1e-6, cos, sin)),
        "gdn_chunked": (gdn_chunked, gdn_reference, (gq, gk, gv, decay, beta, initial)),
        "gdn_chunked_fresh": (gdn_chunked, gdn_reference, (gq, gk, gv, decay, beta, None)),
    }  # fmt: skip


@pytest.mark.parametrize(
    "case", ["add_rms_norm", "swiglu", "output_gate", "qk_norm_rope", "gdn_chunked", "gdn_chunked_fresh"]
)
def test_fused_op_gradients_are_the_references(case):
    """Backward through each fused op equals backward through its plain-torch reference, for every tensor input
    and every output (so the model trains through the ops it infers with)."""
    op, reference, args = _fused_op_cases()[case]
    ours = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    ref = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    outputs, expected = op(*ours), reference(*ref)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    grads = [_rand(*out.shape, seed=20 + i) for i, out in enumerate(outputs)]
    torch.autograd.backward(outputs, grads)
    torch.autograd.backward(expected, grads)
    for i, (mine, theirs) in enumerate(zip(ours, ref, strict=True)):
        if isinstance(mine, torch.Tensor):
            assert mine.grad is not None and torch.equal(mine.grad, theirs.grad), f"input {i}"
