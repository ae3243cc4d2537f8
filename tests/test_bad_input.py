"""Bad files and settings a user can hand the engine are qwen_mtp errors that name the file or key: a broken
config.json, a corrupt tokenizer, a recipe that is a directory or not UTF-8, a device that does not exist."""

import json
import shutil

import pytest
import torch

from qwen_mtp import CheckpointError, ConfigError, Engine, RecipeError


@pytest.fixture
def broken_copy(checkpoint, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny"), path)
    return path


def from_path(path, **model):
    return Engine.from_recipe({"model": {"path": str(path), "device": "cpu", **model}}, log=lambda _: None)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda good: bytes(range(256)) * 8, r"cannot read the tokenizer file .*tokenizer\.json: 'utf-8' codec"),
        (lambda good: good[: len(good) // 2], r"cannot read the tokenizer file .*tokenizer\.json: Expecting"),
        (lambda good: b"", r"cannot read the tokenizer file .*tokenizer\.json"),
        (lambda good: b'{"version": "1.0"}', r"cannot load the tokenizer \(tokenizer\.json / tokenizer_config\.json\)"),
    ],
    ids=["garbage-bytes", "truncated-json", "empty", "json-but-no-tokenizer"],
)
def test_corrupt_tokenizer_json_is_named(broken_copy, damage, message):
    file = broken_copy / "tokenizer.json"
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        from_path(broken_copy)


def test_corrupt_tokenizer_config_is_named(broken_copy):
    (broken_copy / "tokenizer_config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match=r"cannot read the tokenizer file .*tokenizer_config\.json"):
        from_path(broken_copy)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(num_hidden_layers="four"), r"num_hidden_layers must be an integer >= 1, got 'four'"),
        (lambda c: c.update(num_key_value_heads=0), r"num_key_value_heads must be an integer >= 1, got 0"),
        (lambda c: c.update(full_attention_interval=0), r"full_attention_interval must be an integer >= 1, got 0"),
        (lambda c: c.update(eos_token_id="x"), r"eos_token_id must be a token id .*got 'x'"),
    ],
)
def test_broken_config_json_through_the_engine(broken_copy, edit, message):
    config = json.loads((broken_copy / "config.json").read_text())
    config.pop("layer_types", None)  # so full_attention_interval is read
    edit(config)
    (broken_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        from_path(broken_copy)


def test_config_json_that_is_a_list(broken_copy):
    (broken_copy / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"config\.json must be a JSON object of settings, got list"):
        from_path(broken_copy)


def test_recipe_directory_and_non_utf8_recipe(tmp_path):
    with pytest.raises(RecipeError, match=f"recipe {tmp_path} is a directory"):
        Engine.from_recipe(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_bytes(b"model: {fixture: tiny}  # \xe9\n")
    with pytest.raises(RecipeError, match=f"recipe file {path} is not UTF-8"):
        Engine.from_recipe(path)


@pytest.mark.parametrize("device", ["cuda:abc", "cuda:-1", "tpu"])
def test_device_that_is_no_device_name(device):
    with pytest.raises(RecipeError, match=f"model.device must be auto, cpu, cuda or cuda:N .*got '{device}'"):
        Engine.from_recipe({"model": {"fixture": "tiny", "device": device}})


def test_cuda_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RecipeError, match="model.device: .*no CUDA device is available"):
        Engine.from_recipe({"model": {"fixture": "tiny", "device": "cuda:0"}})


def test_cuda_index_past_the_last_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RecipeError, match=r"model.device: .*'cuda:2'.* only 2 CUDA device\(s\) are visible"):
        Engine.from_recipe({"model": {"fixture": "tiny", "device": "cuda:2"}})
