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
        ({"model_type": "qwen3_next"}, "missing required key 'num_experts'"),  # a MoE type needs the MoE keys
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


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_hidden_layers": "four"}, r"num_hidden_layers must be an integer >= 1, got 'four'"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be an integer >= 1, got 0"),
        ({"num_hidden_layers": 4.0}, r"num_hidden_layers must be an integer >= 1, got 4\.0"),
        ({"num_hidden_layers": True}, r"num_hidden_layers must be an integer >= 1, got True"),
        ({"num_key_value_heads": 0}, r"num_key_value_heads must be an integer >= 1, got 0"),
        ({"num_attention_heads": -4}, r"num_attention_heads must be an integer >= 1, got -4"),
        ({"num_attention_heads": 3}, r"num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
        ({"linear_num_key_heads": 0}, r"linear_num_key_heads must be an integer >= 1, got 0"),
        ({"linear_num_value_heads": None}, r"missing required key 'linear_num_value_heads'"),
        ({"hidden_size": [64]}, r"hidden_size must be an integer >= 1, got \[64\]"),
        ({"vocab_size": "512"}, r"vocab_size must be an integer >= 1, got '512'"),
        ({"intermediate_size": 0}, r"intermediate_size must be an integer >= 1"),
        ({"head_dim": 0}, r"head_dim must be an integer >= 1, got 0"),
        ({"linear_key_head_dim": 1.5}, r"linear_key_head_dim must be an integer >= 1, got 1\.5"),
        ({"linear_value_head_dim": -1}, r"linear_value_head_dim must be an integer >= 1"),
        ({"linear_conv_kernel_dim": 0}, r"linear_conv_kernel_dim must be an integer >= 1, got 0"),
        ({"max_position_embeddings": "long"}, r"max_position_embeddings must be an integer >= 1, got 'long'"),
        ({"mtp_num_hidden_layers": -1}, r"mtp_num_hidden_layers must be an integer >= 0, got -1"),
        ({"full_attention_interval": 0}, r"full_attention_interval must be an integer >= 1, got 0"),
        ({"full_attention_interval": "4"}, r"full_attention_interval must be an integer >= 1, got '4'"),
        ({"layer_types": "full_attention"}, r"layer_types must be a list of"),
        ({"layer_types": [["linear_attention"]] * 4}, r"unknown layer_types \[\'linear_attention\'\]"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps must be a positive number, got 0"),
        ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps must be a positive number, got '1e-6'"),
        ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a positive number, got nan"),
        ({"rope_parameters": [1]}, r"rope_parameters must be an object, got \[1\]"),
        ({"rope_parameters": {"rope_theta": "big"}}, r"rope_parameters\.rope_theta must be a positive number"),
        ({"rope_parameters": {"partial_rotary_factor": 2.0}}, r"partial_rotary_factor must be in \(0, 1\]"),
        ({"rope_parameters": {"partial_rotary_factor": 0.0}}, r"partial_rotary_factor must be a positive number"),
        ({"rope_parameters": {"partial_rotary_factor": 0.09375}}, r"even number of rotary dimensions"),
        ({"eos_token_id": "x"}, r"eos_token_id must be a token id \(an integer >= 0\) or a list of them, got 'x'"),
        ({"eos_token_id": [1, "x"]}, r"eos_token_id must be a token id .*got \[1, 'x'\]"),
        ({"eos_token_id": -1}, r"eos_token_id must be a token id"),
        ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got 'false'"),
        ({"dtype": 16}, r"dtype must be a string, got 16"),
        ({"model_type": ["qwen3_5_text"]}, r"model_type must be a string"),
        ({"quantization_config": "fp8"}, r"quantization_config must be an object, got 'fp8'"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, "x"]}},
            r"weight_block_size \[rows, cols\].*got \[128, 'x'\]",
        ),
    ],
)
def test_bad_values_name_the_key(change, message):
    """A wrongly typed, non-positive or non-dividing value is a ConfigError naming the key and the value, not a
    ValueError / TypeError / ZeroDivisionError from deep inside the parser."""
    text = preset_text_config("tiny")
    text.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(text)


def test_bad_values_in_the_vlm_wrapper_name_the_text_config_key():
    text = dict(preset_text_config("tiny"), num_key_value_heads=0)
    with pytest.raises(ConfigError, match=r"text_config\.num_key_value_heads must be an integer >= 1, got 0"):
        ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text})
    with pytest.raises(ConfigError, match=r"text_config must be an object"):
        ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": [text]})


def test_null_optional_keys_take_their_defaults():
    """Hugging Face writes `null` for unset keys: they read as absent (num_key_value_heads = num_attention_heads)."""
    text = dict(preset_text_config("tiny"), num_key_value_heads=None, head_dim=None, eos_token_id=None)
    config = ModelConfig.from_dict(text)
    assert config.num_key_value_heads == 4 and config.head_dim == 64 // 4 and config.eos_token_ids == ()


def test_bad_generation_config_eos_is_named():
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id must be a token id"):
        ModelConfig.from_dict(preset_text_config("tiny"), {"eos_token_id": "x"})
    with pytest.raises(ConfigError, match=r"generation_config\.json must be a JSON object, got list"):
        ModelConfig.from_dict(preset_text_config("tiny"), [1])


@pytest.mark.parametrize(
    "content,message",
    [
        (b"[1, 2, 3]", r"config\.json must be a JSON object of settings, got list"),
        (b'"qwen"', r"config\.json must be a JSON object of settings, got str"),
        (b'{"model_type": "qwen3_5_text", ', r"cannot read .*config\.json"),
        (b"\xff\xfe\x00garbage", r"cannot read .*config\.json"),
    ],
)
def test_unreadable_config_file_is_named(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_pretrained(tmp_path)


def test_config_file_that_is_a_directory(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=r"cannot read .*config\.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"not found: is .* a Hugging Face checkpoint directory"):
        ModelConfig.from_pretrained(tmp_path / "nowhere")
