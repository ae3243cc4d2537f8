"""`qwen-mtp bench`'s roofline on MoE models counts the bytes of the experts a step touches, not all of them."""

from types import SimpleNamespace

import pytest

from qwen_mtp import bench


@pytest.mark.parametrize("k", [0, 2])
def test_step_bytes_count_the_touched_experts(k):
    from qwen_mtp import Engine

    recipe = {"model": {"fixture": "tiny-moe", "dtype": "float32", "device": "cpu"}}
    if k:
        recipe["mtp"] = {"enabled": True, "k": k}
    engine = Engine.from_recipe(recipe, log=lambda _: None)
    weights = bench.weight_bytes(SimpleNamespace(model=engine.model))
    moe = engine.config.moe
    expert = 3 * engine.config.hidden_size * moe.intermediate_size * 4  # gate, up and down of one fp32 expert
    assert weights["target_moe"] == [(moe.num_experts, moe.top_k, expert)] * 4
    assert weights["mtp_moe"] == [(moe.num_experts, moe.top_k, expert)]
    all_experts = moe.num_experts * expert
    got = bench.step_bytes(engine, weights, batch=1, k=k, context=10.0)
    # One token per draft step touches exactly top-k experts; the verify's k + 1 tokens the expected number
    # of distinct experts under uniform routing.
    touched = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** (k + 1))
    target = weights["target"] - 4 * all_experts + 4 * touched * expert
    mtp = weights["mtp_step"] - all_experts + moe.top_k * expert
    assert got["weights"] == pytest.approx(target + k * mtp)
    assert got["weights"] < weights["target"] + k * weights["mtp_step"]
