"""The CPU references' batch invariance, below the engine: `ops/elementwise.py`'s invariant sigmoid / silu /
softplus round an element the same in any tensor, and `rowwise_products` computes a row among many exactly as
alone (bf16 included, where oneDNN picks its kernel by the product's size). tests/test_batch_invariance.py checks
the whole decode and verify path bit for bit."""

import pytest
import torch

from qwen_mtp.ops import elementwise
from qwen_mtp.ops.linear import rowwise_linear


def _rand(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("function", [elementwise.sigmoid, elementwise.silu, elementwise.softplus])
def test_invariant_elementwise_rounds_an_element_alike_in_any_tensor(function, dtype):
    x = _rand(40, 48, dtype=dtype, scale=4.0)  # 48 wide: rows straddle torch's vector steps (32 fp32 a step)
    whole = function(x, True)
    for i in range(x.shape[0]):
        assert torch.equal(function(x[i : i + 1], True), whole[i : i + 1])
    assert torch.equal(function(x.reshape(8, 5, 48), True), whole.reshape(8, 5, 48))  # a verify step's layout
    # every element as torch computes a lone one (fewer elements than a vector step: its scalar loop)
    flat, alone = x.flatten(), torch.stack([function(v.reshape(1), False)[0] for v in x.flatten()])
    assert torch.equal(whole.flatten(), alone) and flat.shape == alone.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (32, 64), (4, 64), (160, 96)])
def test_rowwise_linear_rows_in_a_batch_equal_rows_alone(dtype, out_features, in_features):
    """64 x 64 in bf16 is where oneDNN took over at 2 rows but not at 1: a bf16 `bmm` of the rows rounded 2 of
    these 2048 rows differently from the rows alone."""
    weight = _rand(out_features, in_features, dtype=dtype, seed=1, scale=in_features**-0.5)
    x = _rand(2048, in_features, dtype=dtype, seed=2)
    alone = torch.cat([rowwise_linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    for batch in (2, 8, 40):
        batched = torch.cat([rowwise_linear(x[s : s + batch], weight) for s in range(0, x.shape[0], batch)])
        assert torch.equal(batched, alone), f"{int((batched != alone).any(-1).sum())} rows differ at batch {batch}"
    verify = rowwise_linear(x[:40].reshape(8, 5, in_features), weight)  # [B, T, K]: 8 requests x 5 tokens
    assert torch.equal(verify.reshape(40, out_features), alone[:40])
