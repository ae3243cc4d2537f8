"""`Engine` API: recipes, tokenizer round trip, request validation, features not yet available, compile settings
that cannot work."""

import pytest

from qwen_mtp import Engine, RecipeError, RequestError


@pytest.fixture(scope="module")
def engine():
    return Engine.from_recipe({"model": {"fixture": "tiny", "dtype": "float32", "device": "cpu"}})


def test_fixture_recipe_runs_text_prompts(engine):
    ids = engine.encode("Hello world! How are you today?")
    assert engine.decode(ids) == "Hello world! How are you today?"
    [result] = engine.generate([ids], max_new_tokens=5, ignore_eos=True)
    assert len(result.token_ids) == 5 and result.finish_reason == "length" and result.prompt_len == len(ids)


@pytest.mark.parametrize(
    "prompt,max_new,message",
    [
        ([], 4, "empty prompt"),
        ([1, 512], 4, r"outside the vocabulary \[0, 512\): \[512\]"),
        ([-1], 4, "outside the vocabulary"),
        ([1, 2], 0, "max_new_tokens must be an integer >= 1"),
        ([1] * 4000, 200, "exceeds the model's max_position_embeddings"),
    ],
)
def test_bad_requests_raise(engine, prompt, max_new, message):
    with pytest.raises(RequestError, match=message):
        engine.generate([[1, 2, 3], prompt], max_new_tokens=max_new)


@pytest.mark.parametrize("override", ["parallel.tp=2", "model.quant=fp8-block"])
def test_features_not_yet_available_are_refused_by_key(override):
    key = override.split("=")[0]
    with pytest.raises(RecipeError, match=key):
        Engine.from_recipe({"model": {"fixture": "tiny", "device": "cpu"}}, (override,))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("compile.cuda_graphs=true",), "compile.cuda_graphs needs a CUDA device"),
        (("compile.enabled=true", "compile.batch_sizes=[1, 2]", "cache.max_batch=4"), "must cover cache.max_batch"),
        (("compile.backend=tvm",), "compile.backend must be one of"),
        (("compile.prefill=true",), "compile.prefill needs compile.enabled"),
    ],
)
def test_impossible_compile_settings_are_refused(overrides, message):
    with pytest.raises(RecipeError, match=message):
        Engine.from_recipe({"model": {"fixture": "tiny", "device": "cpu"}}, overrides)
