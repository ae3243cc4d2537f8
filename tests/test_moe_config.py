"""MoE config.json parsing: Qwen3.5-MoE (VLM wrapper and text config) and Qwen3-Next keys, as HF reads them."""

import pytest

from qwen_mtp import ConfigError, ModelConfig
from qwen_mtp.config import MoeConfig
from qwen_mtp.model.plan import plan_model
from qwen_mtp.testing.checkpoint import preset_text_config


def test_qwen3_5_moe_wrapper_and_text_config_agree():
    text = preset_text_config("tiny-moe")
    flat = ModelConfig.from_dict(text)
    wrapped = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text})
    assert flat == wrapped and flat.model_type == "qwen3_5_moe_text"
    assert flat.moe == MoeConfig(8, 2, 32, 48, norm_topk_prob=True)
    assert flat.moe_layers == (0, 1, 2, 3) and flat.intermediate_size == 0  # no dense layer, no dense width
    assert not flat.interleaved_gdn_projections


def test_qwen3_next_layers_follow_sparse_step_and_mlp_only_layers():
    text = preset_text_config("tiny-next", num_hidden_layers=8, decoder_sparse_step=2, norm_topk_prob=False)
    config = ModelConfig.from_dict(text)
    assert config.moe_layers == (3, 5, 7)  # (i + 1) % 2 == 0, minus mlp_only_layers [1]
    assert config.moe.norm_topk_prob is False and config.intermediate_size == 96
    assert config.mtp_num_hidden_layers == 1  # no MTP-count key: one MTP layer
    assert config.rope_theta == 1e7 and config.interleaved_gdn_projections
    plan = plan_model(config)
    assert [spec.moe is not None for spec in plan.layers] == [i in (3, 5, 7) for i in range(8)]
    assert plan.mtp_layers[0].moe == config.moe  # the MTP block's MLP is the same MoE
    assert ModelConfig.from_dict(dict(text, num_nextn_predict_layers=0)).mtp_num_hidden_layers == 0
    assert ModelConfig.from_dict(dict(text, num_experts=0)).moe is None  # HF: num_experts 0 is a dense model


@pytest.mark.parametrize(
    "preset,change,message",
    [
        ("tiny-moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 is more than num_experts=8"),
        ("tiny-moe", {"moe_intermediate_size": None}, r"missing required key 'moe_intermediate_size'"),
        ("tiny-moe", {"num_experts": 0}, r"num_experts must be an integer >= 1, got 0"),
        ("tiny-next", {"mlp_only_layers": "1"}, r"mlp_only_layers must be a list of layer indices, got '1'"),
        ("tiny-next", {"norm_topk_prob": 1}, r"norm_topk_prob must be true or false, got 1"),
        ("tiny-next", {"mlp_only_layers": [], "intermediate_size": None}, None),  # all MoE: no dense width needed
        ("tiny-next", {"intermediate_size": None}, r"missing required key 'intermediate_size'"),  # layer 1 is dense
    ],
)
def test_bad_moe_values_name_the_key(preset, change, message):
    text = {k: v for k, v in dict(preset_text_config(preset), **change).items() if v is not None}
    if message is None:
        ModelConfig.from_dict(text)
        return
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(text)


def test_wrapper_with_another_families_text_config_is_refused():
    with pytest.raises(ConfigError, match=r"text_config.model_type 'qwen3_5_text' does not belong in a 'qwen3_5_moe'"):
        ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": preset_text_config("tiny")})
