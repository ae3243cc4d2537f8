"""Linear layers that own their weight (`Linear`, `MergedLinear`) and the one linear op they call,
`qwen_mtp::linear`: the products Hugging Face computes on CPU, the one-GEMM layout CUDA runs, gradients, and what
torch.compile needs of the op."""

import pytest
import torch
import torch.nn.functional as F

from qwen_mtp.model import Linear, MergedLinear
from qwen_mtp.ops.linear import linear, rowwise_linear

SEGMENTS = [("in_proj_qkv", 40), ("in_proj_z", 24), ("in_proj_b", 3), ("in_proj_a", 3)]  # a GDN in_proj shape


def _merged(dtype: torch.dtype, seed: int = 0) -> tuple[MergedLinear, dict[str, torch.nn.Linear]]:
    """A MergedLinear loaded segment by segment, and the separate nn.Linear projections HF would hold."""
    gen = torch.Generator().manual_seed(seed)
    merged = MergedLinear(32, SEGMENTS).to(dtype)
    separate = {}
    for name, rows in SEGMENTS:
        separate[name] = torch.nn.Linear(32, rows, bias=False, dtype=dtype)
        with torch.no_grad():
            separate[name].weight.copy_(torch.randn(rows, 32, generator=gen))
        merged.weight_loader(separate[name].weight, name)
    return merged, separate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_linear_on_cpu_computes_what_separate_projections_compute(dtype):
    merged, separate = _merged(dtype)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    outputs = merged(x)
    assert len(outputs) == len(SEGMENTS)
    for (name, _), out in zip(SEGMENTS, outputs, strict=True):
        assert torch.equal(out, separate[name](x)), name
        assert torch.equal(merged.segment_weight(name), separate[name].weight)
    assert torch.equal(merged.fused(x), torch.cat([separate[name](x) for name, _ in SEGMENTS], dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_linear_one_gemm_is_one_product_sliced(dtype):
    """The CUDA layout on CPU: one GEMM over the fused weight, segments as strided slices of its output,
    equal to the per-segment products up to the GEMM's rounding."""
    merged, _ = _merged(dtype)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    per_segment = merged(x)
    merged.one_gemm = True
    one_gemm = merged(x)
    base = one_gemm[0].untyped_storage().data_ptr()
    for out, expected in zip(one_gemm, per_segment, strict=True):
        assert out.untyped_storage().data_ptr() == base and out.stride(-2) == merged.weight.shape[0]
        torch.testing.assert_close(out, expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    assert torch.equal(merged.fused(x), F.linear(x, merged.weight))


def test_linear_owns_its_weight_and_loads_checkpoint_tensors():
    layer = Linear(8, 5)
    assert dict(layer.named_parameters()).keys() == {"weight"} and layer.weight.shape == (5, 8)
    tensor = torch.randn(5, 8, dtype=torch.float64)
    layer.weight_loader(tensor)
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, tensor.float())
    x = torch.randn(4, 8)
    assert torch.equal(layer(x), F.linear(x, tensor.float()))
    assert torch.equal(layer(x, invariant=True), rowwise_linear(x, tensor.float()))


def test_merged_linear_refuses_duplicate_segment_names():
    with pytest.raises(ValueError, match="distinct"):
        MergedLinear(8, [("q_proj", 4), ("q_proj", 4)])


def test_invariant_linear_rows_do_not_depend_on_the_batch():
    """invariant=True: each row of a batch equals that row computed alone, bit for bit (the decode path)."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    full = linear(x, weight, True)
    assert all(torch.equal(linear(x[i : i + 1], weight, True), full[i : i + 1]) for i in range(9))
    torch.testing.assert_close(full, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("invariant", [False, True])
def test_linear_op_gradients_equal_f_linear(invariant):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, generator=gen, dtype=torch.float64)[..., :12]  # strided, as projection slices are
    weight = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    ours = [t.clone().requires_grad_() for t in (x, weight)]
    ref = [t.clone().requires_grad_() for t in (x, weight)]
    linear(*ours, invariant).backward(grad)
    F.linear(*ref).backward(grad)
    for mine, theirs in zip(ours, ref, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: linear(a, b, invariant), [t.detach().requires_grad_() for t in ours])
    only_x = x.clone().requires_grad_()
    linear(only_x, weight, invariant).sum().backward()  # a frozen weight: no gradient asked for it
    assert only_x.grad is not None


@pytest.mark.parametrize("invariant", [False, True])
def test_linear_op_passes_opcheck_with_strided_inputs(invariant):
    """The fake agrees with the real kernel (shape, strides), the schema holds, autograd is registered
    properly and the op traces under AOT dispatch: what torch.compile and CUDA graphs rely on."""
    gen = torch.Generator().manual_seed(6)
    strided = torch.randn(2, 3, 16, generator=gen)[..., :8]  # like one half of q_proj's [q | gate] chunk
    weight = torch.randn(5, 8, generator=gen)
    torch.library.opcheck(torch.ops.qwen_mtp.linear, (strided, weight, invariant))
    torch.library.opcheck(torch.ops.qwen_mtp.linear, (strided.requires_grad_(), weight.requires_grad_(), invariant))
    assert torch.ops.qwen_mtp.linear(strided, weight, invariant).is_contiguous()
