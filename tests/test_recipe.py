"""Recipes: defaults, overrides, and errors that name the bad key."""

import pytest

from qwen_mtp import RecipeError
from qwen_mtp.recipe import load_recipe


def test_defaults_and_yaml_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {fixture: tiny}\nmtp: {enabled: true, k: 3}\nrun: {prompts: [[1, 2, 3], hi]}\n")
    recipe = load_recipe(path)
    assert recipe.model.fixture == "tiny" and recipe.model.dtype == "bfloat16"
    assert recipe.mtp.enabled and recipe.mtp.k == 3 and recipe.state.dtype == "float32"
    assert recipe.cache.page_size == 64 and recipe.run.prompts == [[1, 2, 3], "hi"]


def test_overrides_are_typed():
    recipe = load_recipe(
        {"model": {"fixture": "tiny"}},
        ["mtp.k=4", "mtp.enabled=true", "cache.memory_fraction=0.5", "run.prompts=[[5, 6]]", "model.dtype=float32"],
    )
    assert recipe.mtp.k == 4 and recipe.mtp.enabled is True and recipe.cache.memory_fraction == 0.5
    assert recipe.run.prompts == [[5, 6]] and recipe.model.dtype == "float32"


def test_float_field_accepts_int():
    assert load_recipe({"model": {"fixture": "tiny"}, "mtp": {"oracle_accept": 1}}).mtp.oracle_accept == 1.0


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"model": {"fixture": "tiny"}, "mtp": {"k": 7}}, r"mtp\.k must be 1\.\.4, got 7"),
        ({"model": {"fixture": "tiny"}, "mtp": {"kk": 2}}, r"unknown key mtp\.kk"),
        ({"model": {"fixture": "tiny"}, "speculation": {}}, r"unknown key speculation"),
        ({"model": {"fixture": "tiny"}, "mtp": {"enabled": "yes"}}, r"mtp\.enabled must be true/false"),
        ({"model": {"fixture": "tiny"}, "cache": {"page_size": 0}}, r"cache\.page_size must be >= 1"),
        ({"model": {"fixture": "tiny"}, "cache": {"max_batch": 2.5}}, r"cache\.max_batch must be an integer"),
        ({"model": {"fixture": "tiny", "dtype": "int8"}}, r"model\.dtype must be one of"),
        ({"model": {"fixture": "huge"}}, r"model\.fixture must be one of"),
        ({"model": {}}, r"exactly one of model\.path, model\.fixture or model\.synthetic"),
        (
            {"model": {"fixture": "tiny", "path": "/x"}},
            r"exactly one of model\.path, model\.fixture or model\.synthetic",
        ),
        ({"model": {"fixture": "tiny"}, "state": {"dtype": "fp8"}}, r"state\.dtype must be float32 or bfloat16"),
        ({"model": {"fixture": "tiny"}, "run": {"max_new_tokens": 0}}, r"run\.max_new_tokens must be >= 1"),
        ({"model": {"fixture": "tiny"}, "run": {"prompts": [[1, -2]]}}, r"run\.prompts\[0\]"),
        ({"model": {"fixture": "tiny"}, "mtp": 3}, r"mtp must be a mapping"),
        ({"model": {"fixture": "tiny"}, "mtp": {"oracle_accept": 1.5}}, r"mtp\.oracle_accept must be in 0\.\.1"),
    ],
)
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(raw)


@pytest.mark.parametrize("item", ["mtp.k", "k=4", "a.b.c=1", "=3"])
def test_malformed_override(item):
    with pytest.raises(RecipeError, match="--set expects section.key=value"):
        load_recipe({"model": {"fixture": "tiny"}}, [item])


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
