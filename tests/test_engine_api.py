"""`Engine` API: recipes, tokenizer round trip, request validation (SamplingParams, prompt types), request ids and
results, features not yet available, compile settings that cannot work."""

import numpy as np
import pytest
import torch

from qwen_mtp import Engine, RecipeError, RequestError, SamplingParams
from qwen_mtp.engine.sizing import check_forward_rows
from qwen_mtp.model.linear import Linear, MergedLinear
from qwen_mtp.recipe import CacheSection


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


@pytest.mark.parametrize(
    "overrides,key",
    [
        (("parallel.tp=2",), "parallel.tp"),  # outside started ranks
    ],
)
def test_features_not_yet_available_are_refused_by_key(overrides, key):
    with pytest.raises(RecipeError, match=key):
        Engine.from_recipe({"model": {"fixture": "tiny", "device": "cpu"}}, overrides)


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


# ---- SamplingParams and request inputs: each bad value is a RequestError that says what was given -----------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_new_tokens": True}, r"max_new_tokens must be an integer >= 1, got True \(bool\)"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1, got 0"),
        ({"max_new_tokens": 2.0}, r"max_new_tokens must be an integer >= 1, got 2.0 \(float\)"),
        ({"max_new_tokens": "8"}, r"max_new_tokens must be an integer >= 1, got '8' \(str\)"),
        ({"ignore_eos": "yes"}, r"ignore_eos must be true or false, got 'yes' \(str\)"),
        ({"ignore_eos": 1}, r"ignore_eos must be true or false, got 1 \(int\)"),
        ({"stop_token_ids": 7}, r"stop_token_ids must be a list of token ids, got 7 \(int\)"),
        ({"stop_token_ids": "7"}, r"stop_token_ids must be a list of token ids, got '7' \(str\)"),
        ({"stop_token_ids": [3, 1.5]}, r"stop_token_ids must be token ids .*, got 1.5 \(float\)"),
        ({"stop_token_ids": [True]}, r"stop_token_ids must be token ids .*, got True \(bool\)"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be token ids .*, got -1 \(int\)"),
    ],
)
def test_sampling_params_are_validated(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_numpy_ints_and_normalise_stops():
    params = SamplingParams(np.int64(5), stop_token_ids=[np.int32(3), 4])
    assert params.max_new_tokens == 5 and type(params.max_new_tokens) is int
    assert params.stop_token_ids == (3, 4) and all(type(t) is int for t in params.stop_token_ids)


@pytest.mark.parametrize(
    "kwargs,message",
    [({"max_new_tokens": True}, r"max_new_tokens .* got True \(bool\)"), ({"ignore_eos": "yes"}, "ignore_eos")],
)
def test_generate_keywords_are_validated(engine, kwargs, message):
    with pytest.raises(RequestError, match=message):
        engine.generate([[1, 2, 3]], **kwargs)
    assert not engine.requests and engine.stats()["waiting"] == 0


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("Hello", r"a prompt must be token ids, got a str 'Hello': encode text first"),
        (None, r"a prompt must be a list of token ids, got None \(NoneType\)"),
        (True, r"a prompt must be a list of token ids, got True \(bool\)"),
        (3.5, r"a prompt must be a list of token ids, got 3.5 \(float\)"),
        ([1, 2.5, 3], r"token ids must be integers, got 2.5 \(float\) at index 1"),
        ([1, None], r"token ids must be integers, got None \(NoneType\) at index 1"),
        ([True, 2], r"token ids must be integers, got True \(bool\) at index 0"),
        (["a", "b"], r"token ids must be integers, got 'a' \(str\) at index 0"),
        (torch.tensor([1.0, 2.0]), r"a prompt tensor must be 1-D integer token ids, got 1-D torch.float32"),
        (torch.tensor([[1, 2]]), r"a prompt tensor must be 1-D integer token ids, got 2-D torch.int64"),
        (torch.tensor([True, False]), r"a prompt tensor must be 1-D integer token ids, got 1-D torch.bool"),
        (np.array([1.5, 2.0]), r"a prompt numpy array must be 1-D integer token ids, got 1-D float64"),
    ],
)
def test_bad_prompt_types_say_what_was_given(engine, prompt, message):
    with pytest.raises(RequestError, match=message):
        engine.submit(prompt)
    with pytest.raises(RequestError, match=message):
        engine.generate([[1, 2], prompt])
    assert not engine.requests and engine.stats()["waiting"] == 0  # nothing queued, not even the good prompt


@pytest.mark.parametrize(
    "prompts,message",
    [
        ([1, 2, 3], r"got a flat list \(\[1, 2, 3\]\): wrap one prompt as \[\[...\]\]"),
        ("Hello", r"prompts must be a list of prompts .*, got 'Hello'"),
        (None, r"prompts must be a list of prompts .*, got None"),
        (torch.tensor([1, 2, 3]), r"prompts as one array must be 2-D \[prompts, tokens\], got 1-D"),
    ],
)
def test_generate_needs_a_list_of_prompts(engine, prompts, message):
    with pytest.raises(RequestError, match=message):
        engine.generate(prompts, max_new_tokens=2)


def test_params_must_be_sampling_params(engine):
    with pytest.raises(RequestError, match=r"params must be a qwen_mtp.SamplingParams, got int 5"):
        engine.submit([1, 2], 5)


def test_numpy_and_tensor_prompts_are_token_ids(engine):
    ids = [5, 17, 301, 44, 2]
    expected = engine.generate([ids], max_new_tokens=4, ignore_eos=True)[0].token_ids
    for prompt in (np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids), torch.tensor(ids).int()):
        assert engine.generate([prompt], max_new_tokens=4, ignore_eos=True)[0].token_ids == expected
    batch = engine.generate(torch.tensor([ids, ids]), max_new_tokens=4, ignore_eos=True)  # a 2-D tensor: 2 prompts
    assert [r.token_ids for r in batch] == [expected, expected]
    rid = engine.submit(np.array(ids), SamplingParams(4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.result(rid).token_ids == expected


def test_unknown_request_ids_are_request_errors(engine):
    for call in (engine.result, engine.cancel):
        with pytest.raises(RequestError, match="no request 999"):
            call(999)
    rid = engine.submit([1, 2, 3], SamplingParams(2))
    while engine.has_unfinished():
        engine.step()
    engine.result(rid)
    with pytest.raises(RequestError, match=f"no request {rid}: never submitted, or its result was already read"):
        engine.result(rid)


def test_requests_are_dropped_once_their_results_are_read(engine):
    engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=3)
    assert engine.requests == {}
    updates = list(engine.stream([[1, 2, 3], [4, 5]], max_new_tokens=3))
    assert updates and engine.requests == {}
    rid = engine.submit([7, 8, 9], SamplingParams(3))
    assert list(engine.requests) == [rid]
    while engine.has_unfinished():
        engine.step()
    assert list(engine.requests) == [rid]  # finished, result not read yet
    assert len(engine.result(rid).token_ids) <= 3
    assert engine.requests == {}


def test_decode_path_is_reported(engine):
    assert engine.decode_path == "eager"  # CPU: CUDA graphs are only the default on CUDA
    compiled = Engine.from_recipe(
        {"model": {"fixture": "tiny", "device": "cpu"}, "compile": {"enabled": True, "backend": "eager"}},
        log=lambda _: None,
    )
    assert compiled.decode_path == "torch.compile"


def test_a_forward_past_the_kernels_32_bit_offsets_is_refused():
    """At 27B the widest activation row is the MLP's gate_up (34816 elements): a 61680-token forward fits the CUDA
    kernels' 32-bit offsets, 61681 tokens would not."""
    check_forward_rows(61680, 34816, "cache.prefill_chunk")
    with pytest.raises(RecipeError, match=r"cache.prefill_chunk \(61681\).*34816.*use at most 61680"):
        check_forward_rows(61681, 34816, "cache.prefill_chunk")


def test_the_engine_checks_its_chunk_against_its_widest_projection_on_cuda(engine, monkeypatch):
    """The check reads the model's widest projection (the lm_head aside) and runs where the kernels do (CUDA);
    on CPU the references index in 64 bits."""
    widest = max(
        m.weight.shape[0]
        for m in engine.model.modules()
        if isinstance(m, Linear | MergedLinear) and m is not engine.model.lm_head
    )
    huge = CacheSection(prefill_chunk=2**31 // widest + 1)
    engine._check_forward_rows(huge, None)  # CPU: nothing to check
    monkeypatch.setattr(engine, "device", torch.device("cuda"))
    with pytest.raises(RecipeError, match=rf"cache.prefill_chunk .*\({widest} elements\)"):
        engine._check_forward_rows(huge, None)
    engine._check_forward_rows(CacheSection(prefill_chunk=2**31 // widest), None)
    with pytest.raises(RecipeError, match=rf"cache.max_step_tokens .*\({widest} elements\)"):  # a mixed step's budget
        engine._check_forward_rows(CacheSection(), 2**31 // widest + 1)
