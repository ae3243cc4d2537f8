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
        ({"model": {"fixture": "tiny"}, "mtp": {"k": 7}}, r"mtp\.k must be 1\.\.4 or auto, got 7"),
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
        ({"model": {"fixture": "tiny", "device": "cuda:abc"}}, r"model\.device must be auto, cpu, cuda or cuda:N"),
        ({"model": {"fixture": "tiny", "device": "cuda:-1"}}, r"model\.device must be .*got 'cuda:-1'"),
        ({"model": {"fixture": "tiny", "device": "gpu"}}, r"model\.device must be .*got 'gpu'"),
        ({"model": {"fixture": "tiny", "device": 0}}, r"model\.device must be a string, got 0"),
        (
            {"model": {"fixture": "tiny", "dtype": "int8"}},
            r"model\.dtype must be one of float32, bfloat16 or float16, got 'int8'",
        ),
        ({"model": {"fixture": "tiny", "quant": "fp4"}}, r"model\.quant must be none or fp8-block, got 'fp4'"),
        ({"model": {"fixture": "tiny"}, "mtp": {"draft": "model"}}, r"mtp\.draft must be head or oracle, got 'model'"),
        (
            {"model": {"fixture": "tiny"}, "compile": {"backend": "cudagraphs"}},
            r"compile\.backend must be one of inductor, aot_eager or eager, got 'cudagraphs'",
        ),
        (
            {"model": {"fixture": "tiny"}, "compile": {"cuda_graphs": "auto"}},
            r"compile\.cuda_graphs must be true/false or null, got 'auto'",
        ),
        ({"model": {"fixture": "tiny"}, 1: {}}, r"unknown key 1"),
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


def test_allowed_values_are_the_literal_types():
    """The values a Literal-typed key accepts are exactly those its type lists (the one dtype table included)."""
    import typing

    from qwen_mtp.dtypes import DTYPES, STATE_DTYPES
    from qwen_mtp.recipe import CompileSection, ModelSection, MTPSection, StateSection

    hints = {cls: typing.get_type_hints(cls) for cls in (ModelSection, StateSection, MTPSection, CompileSection)}
    assert typing.get_args(hints[ModelSection]["dtype"]) == tuple(DTYPES)
    assert typing.get_args(hints[StateSection]["dtype"]) == tuple(STATE_DTYPES)
    for section, key, cls in [("model", "dtype", ModelSection), ("model", "quant", ModelSection),
                              ("state", "dtype", StateSection), ("mtp", "draft", MTPSection),
                              ("compile", "backend", CompileSection)]:  # fmt: skip
        for value in typing.get_args(hints[cls][key]):
            recipe = load_recipe({"model": {"fixture": "tiny"}}, [f"{section}.{key}={value}"])
            assert getattr(getattr(recipe, section), key) == value


def test_devices_accepted():
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert load_recipe({"model": {"fixture": "tiny", "device": device}}).model.device == device


def test_cuda_graphs_default_is_unset():
    """None: the engine turns CUDA graphs on when the model runs on CUDA; true/false force it."""
    assert load_recipe({"model": {"fixture": "tiny"}}).compile.cuda_graphs is None
    assert load_recipe({"model": {"fixture": "tiny"}}, ["compile.cuda_graphs=false"]).compile.cuda_graphs is False


def test_recipe_path_that_is_a_directory(tmp_path):
    with pytest.raises(RecipeError, match=f"recipe {tmp_path} is a directory"):
        load_recipe(tmp_path)


def test_recipe_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model: {fixture: tiny}\nrun: {prompts: [caf\xe9]}\n".encode("latin-1"))
    with pytest.raises(RecipeError, match=f"recipe file {path} is not UTF-8 text"):
        load_recipe(path)
