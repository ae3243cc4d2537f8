"""HF config.json parsing: both layouts, legacy rope keys, layer types, tie flags, refusals."""

import pytest

from qwen_mtp import ConfigError, ModelConfig
from qwen_mtp.testing.checkpoint import preset_text_config


def test_vlm_wrapper_and_text_config_agree():
    text = preset_text_config("tiny")
    flat = ModelConfig.from_dict(text)
    wrapped = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text})
    assert flat == wrapped
    assert flat.layer_types == ("gdn", "gdn", "gdn", "attn") and flat.rotary_dim == 8


def test_legacy_top_level_rope_and_interval():
    text = preset_text_config("tiny", num_hidden_layers=8, full_attention_interval=2)
    del text["rope_parameters"]
    text.update(rope_theta=5e6, partial_rotary_factor=0.5)
    config = ModelConfig.from_dict(text)
    assert config.rope_theta == 5e6 and config.partial_rotary_factor == 0.5
    assert config.layer_types == ("gdn", "attn") * 4


def test_tie_flag_read_from_either_level():
    text = preset_text_config("tiny")
    assert ModelConfig.from_dict(
        {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
    ).tie_word_embeddings
    assert ModelConfig.from_dict(dict(text, tie_word_embeddings=True)).tie_word_embeddings


def test_eos_ids_merge_generation_config():
    text = preset_text_config("tiny", eos_token_id=7)
    assert ModelConfig.from_dict(text, {"eos_token_id": [9, 7]}).eos_token_ids == (9, 7)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "qwen3_next"}, "not supported yet"),
        ({"model_type": "bert"}, "unsupported model_type 'bert'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, "unknown layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"linear_num_value_heads": 3}, "not a multiple"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
    ],
)
def test_refusals_are_clear(change, message):
    text = preset_text_config("tiny")
    text.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(text)


def test_missing_key_is_named():
    text = preset_text_config("tiny")
    del text["linear_key_head_dim"]
    with pytest.raises(ConfigError, match="missing required key 'linear_key_head_dim'"):
        ModelConfig.from_dict(text)
