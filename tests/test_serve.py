"""`qwen-mtp serve` on loopback, driven by the real `openai` client and `httpx`: answers equal the engine's own
greedy output (MTP on == MTP off), streaming, concurrency, cancellation on disconnect, limits, errors, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import LiveServer, tiny_recipe

import qwen_mtp
from qwen_mtp.engine import Engine, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"model": "qwen-mtp", "temperature": 0}
LONG = {"extra_body": {"ignore_eos": True}}  # an extension (vLLM's name): the openai client sends it as extra_body


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    """The same checkpoint on its own engine (MTP off): what every answer must equal."""
    return Engine.from_recipe(tiny_recipe(chat_checkpoint), log=lambda line: None)


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    with LiveServer.from_recipe(tiny_recipe(chat_checkpoint)) as live:
        yield live


@pytest.fixture(scope="module")
def mtp_server(chat_checkpoint):
    with LiveServer.from_recipe(tiny_recipe(chat_checkpoint, "mtp.enabled=true", "mtp.k=3")) as live:
        yield live


@pytest.fixture(scope="module")
def small_server(checkpoint):
    """One running request, one waiting, a 2 s timeout; the plain checkpoint (no chat template)."""
    recipe = tiny_recipe(checkpoint(), "cache.max_batch=1", "server.max_queue=1", "server.request_timeout_s=2.0")
    with LiveServer.from_recipe(recipe) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_server(checkpoint, tmp_path_factory):
    """`server.api_key` set, over a copy of the checkpoint whose generation_config.json asks for top_k 1 (greedy
    whatever the temperature) as a default."""
    path = tmp_path_factory.getbasetemp() / "tiny-generation-config"
    if not path.exists():
        shutil.copytree(checkpoint(), path)
        config = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps(config | {"top_k": 1, "temperature": 0.9}))
    with LiveServer.from_recipe(tiny_recipe(path, "server.api_key=s3cret")) as live:
        yield live


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0)


def aclient(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.url, api_key="none", max_retries=0)


def expected(reference: Engine, prompt: list[int], max_tokens: int) -> str:
    (result,) = reference.generate([prompt], SamplingParams(max_tokens))
    return text_of(reference, result.token_ids)


def text_of(engine: Engine, token_ids: list[int]) -> str:
    """Output text as the API returns it: without special tokens (an EOS that ended the request)."""
    return engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_completion_equals_engine_greedy_output(server, reference):
    prompt = reference.encode("The quick brown fox")
    out = client(server).completions.create(prompt="The quick brown fox", max_tokens=12, **GREEDY)
    assert out.choices[0].text == expected(reference, prompt, 12)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_completion_equals_unstreamed(server, reference):
    prompt = [5, 17, 42, 99, 3]
    chunks = list(
        client(server).completions.create(
            prompt=prompt, max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(reference, prompt, 16)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len([c for c in chunks if c.choices]) > 1  # it really streamed


def test_several_prompts_and_echo(server, reference):
    prompts = [[7, 8, 9], [100, 200, 300, 400]]
    out = client(server).completions.create(prompt=prompts, max_tokens=5, echo=True, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt in zip(out.choices, prompts, strict=True):
        assert choice.text == reference.decode(prompt) + expected(reference, prompt, 5)
    assert out.usage.prompt_tokens == 7


def test_chat_completion_through_the_template(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    prompt = reference.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    )
    want = expected(reference, prompt, 10)
    out = client(server).chat.completions.create(messages=messages, max_tokens=10, **GREEDY)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(prompt)
    stream = client(server).chat.completions.create(messages=messages, max_tokens=10, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    tokens = httpx.post(server.base + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == prompt


def test_chat_template_kwargs_reach_the_template(server, reference):
    """`chat_template_kwargs` (vLLM's and SGLang's extension), e.g. Qwen's enable_thinking: in chat completions
    and /tokenize; the arguments the server sets itself are refused."""
    messages = [{"role": "user", "content": "Hi"}]
    plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    prompt = reference.encode(plain + "<think>\n\n</think>\n\n")
    extra = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    out = client(server).chat.completions.create(messages=messages, max_tokens=6, **GREEDY, **extra)
    assert out.usage.prompt_tokens == len(prompt) and out.choices[0].message.content == expected(reference, prompt, 6)
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(server.base + "/tokenize", json=body).json()["tokens"] == prompt
    default = httpx.post(server.base + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert default == reference.encode(plain)
    bad = {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}, **GREEDY}
    response = httpx.post(server.url + "/chat/completions", json=bad)
    assert response.status_code == 400 and "add_generation_prompt" in response.json()["error"]["message"]


def test_chat_without_a_template_is_a_clear_400(small_server):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(small_server).chat.completions.create(messages=[{"role": "user", "content": "hi"}], **GREEDY)


def test_mtp_on_answers_equal_mtp_off(server, mtp_server, reference):
    prompts = [reference.encode(t) for t in ("Hello world! How are you", "Once upon a time", "def add(a, b):")]
    prompts += [[3, 1, 4, 1, 5, 9, 2, 6]]

    async def answers(live):
        async with aclient(live) as c:
            outs = await asyncio.gather(
                *(c.completions.create(prompt=p, max_tokens=20, **LONG, **GREEDY) for p in prompts)
            )
        return [o.choices[0].text for o in outs]

    assert asyncio.run(answers(mtp_server)) == asyncio.run(answers(server))
    m = mtp_server.metrics()
    assert m["qwen_mtp_spec_drafted_tokens_total"] > 0 and m["qwen_mtp_spec_acceptance_length"] >= 1.0
    assert "qwen_mtp_spec_position_acceptance{position=3}" in m
    assert m["qwen_mtp_spec_step_k"] == 3 and not any(name.startswith("qwen_mtp_spec_k_auto") for name in m)


def test_64_concurrent_requests_all_answered_correctly(server, reference):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 400) for _ in range(rng.randrange(1, 24))] for _ in range(64)]
    lengths = [rng.randrange(1, 12) for _ in prompts]
    ids = [reference.submit(p, SamplingParams(n)) for p, n in zip(prompts, lengths, strict=True)]
    while reference.has_unfinished():
        reference.step()
    want = [text_of(reference, reference.result(i).token_ids) for i in ids]

    async def one(c, prompt, n, stream):
        if not stream:
            return (await c.completions.create(prompt=prompt, max_tokens=n, **GREEDY)).choices[0].text
        chunks = await c.completions.create(prompt=prompt, max_tokens=n, stream=True, **GREEDY)
        return "".join([chunk.choices[0].text async for chunk in chunks])

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with openai.AsyncOpenAI(
            base_url=server.url, api_key="none", max_retries=0, http_client=httpx.AsyncClient(limits=limits)
        ) as c:
            return await asyncio.gather(
                *(one(c, p, n, i % 2 == 0) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)))
            )

    assert asyncio.run(run()) == want
    server.wait_all_free()


def test_disconnect_mid_stream_frees_pages(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True, **GREEDY}
    before = server.metrics().get("qwen_mtp_requests_finished_total{finish_reason=cancelled}", 0.0)
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        m = server.metrics()
        assert m["qwen_mtp_kv_pages_in_use"] > 0 and m["qwen_mtp_state_rows_in_use"] == 1
    m = server.wait_all_free()  # the client closed the connection: the request was cancelled
    assert m["qwen_mtp_requests_finished_total{finish_reason=cancelled}"] == before + 1


def test_disconnect_while_waiting_for_a_whole_answer_frees_pages(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, **GREEDY}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/completions", json=body, timeout=0.5)  # the client gives up and closes
    server.wait_all_free()


def test_queue_bound_answers_429_then_frees(small_server):
    body = {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True, **GREEDY}
    with httpx.Client(base_url=small_server.url, timeout=30) as http:
        with http.stream("POST", "/completions", json=body) as running, http.stream("POST", "/completions", json=body):
            assert running.status_code == 200
            with pytest.raises(openai.RateLimitError, match="requests in flight"):
                client(small_server).completions.create(prompt=[1], max_tokens=1, **GREEDY)
    small_server.wait_all_free()


def test_request_timeout_ends_with_finish_reason_timeout(small_server):
    out = client(small_server).completions.create(prompt=[1, 2], max_tokens=4000, **LONG, **GREEDY)
    assert out.choices[0].finish_reason == "timeout"
    assert 0 < out.usage.completion_tokens < 4000
    small_server.wait_all_free()


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"prompt": "hi", "max_tokens": ', 400, "not valid JSON"),
        ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": "hi", "max_token": 3}, 400, "max_token"),
        ({"prompt": [1, 2, True]}, 400, "prompt"),
        ({"prompt": [1] * 4097, "max_tokens": 1, **GREEDY}, 400, "max_position_embeddings"),
        ({"prompt": [1], "max_tokens": 4096, **GREEDY}, 400, "max_position_embeddings"),
        ({"prompt": [10**9], "max_tokens": 1, **GREEDY}, 400, "outside the vocabulary"),
        ({"prompt": "hi", "max_tokens": 0, **GREEDY}, 400, "needs echo"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "not served here"),
        ({"prompt": "hi", "presence_penalty": 2.5, **GREEDY}, 400, "presence_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0, **GREEDY}, 400, "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"a": 1}, **GREEDY}, 400, "logit_bias"),
        ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3, **GREEDY}, 400, "min_tokens"),
        ({"prompt": "hi", "logit_bias": {"5": 200}, **GREEDY}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"999999": 1}, **GREEDY}, 400, "outside the vocabulary"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(server, body, status, message):
    if isinstance(body, bytes):
        response = httpx.post(server.url + "/completions", content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(server.url + "/completions", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"] + str(response.json()["error"]["param"])
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}  # and it goes on serving


def test_models_health_tokenize_detokenize(server, reference):
    assert client(server).models.list().data[0].id == "qwen-mtp"
    ids = httpx.post(server.base + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert ids == reference.encode("Hello world")
    assert httpx.post(server.base + "/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}


def test_metrics_parse_and_count(server):
    client(server).completions.create(prompt=[4, 5, 6], max_tokens=3, **LONG, **GREEDY)
    m = server.metrics()
    assert m["qwen_mtp_time_to_first_token_seconds_count"] >= 1
    assert m["qwen_mtp_time_per_output_token_seconds_count"] >= 1
    assert m["qwen_mtp_generation_tokens_total"] >= 3 and m["qwen_mtp_generation_tokens_per_second"] > 0
    assert m["qwen_mtp_kv_pages_total"] == server.engine.pages.num_pages
    assert m["qwen_mtp_state_rows_total"] == server.engine.states.num_rows
    assert {"qwen_mtp_queue_depth", "qwen_mtp_requests_running"} <= set(m)


def test_sigterm_stops_the_cli_server_gracefully(tmp_path, chat_checkpoint):
    exe = shutil.which("qwen-mtp")
    assert exe, "the qwen-mtp console script is not installed (pip install -e .)"
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(f"model:\n  path: {chat_checkpoint}\n  dtype: float32\n  device: cpu\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [exe, "serve", str(recipe), "--port", "0"], stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited before serving"
        url = line.split(" on ")[1].split()[0]
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True, **GREEDY}
        with httpx.stream("POST", url + "/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)  # mid-stream: the running request still finishes
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "server stopped" in proc.stderr.read()


def test_load_test_script_reports_and_finds_pages_free(server, tmp_path):
    """benchmarks/load_test.py against a running server (--base-url), as the H200 run uses it."""
    out = tmp_path / "load.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "load_test.py"),
        "--base-url",
        server.url,
        "--concurrency",
        "8",
        "--requests",
        "16",
        "--prompt-len",
        "12",
        "--max-tokens",
        "6",
        "--vocab",
        "200",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["completed"] == 16 and report["errors"] == {} and report["output_tokens"] == 16 * 6
    assert report["ttft_s"]["p50"] > 0 and report["tpot_s"]["p99"] > 0 and report["output_tokens_per_s"] > 0
    assert report["server"]["all_free_after"] is True


def test_echo_logprobs_with_max_tokens_0_are_prompt_logprobs(server, reference):
    """lm-eval's local-completions loglikelihood: echo + logprobs returns every prompt position's logprob."""
    prompt = reference.encode("The quick brown fox jumps")
    out = client(server).completions.create(prompt=prompt, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == reference.decode(prompt) and out.usage.completion_tokens == 0
    assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None
    (direct,) = reference.generate([prompt], SamplingParams(1, prompt_logprobs=1))
    assert lp.token_logprobs[1:] == [e.logprob for e in direct.prompt_logprobs[1:]]


def test_streamed_logprobs_joined_equal_the_whole_answer_s(server, reference):
    """A streamed completion's chunks, joined, carry the log-probabilities of the same request unstreamed:
    `text_offset` counts from the answer's start, not from each chunk's."""
    kwargs = {"prompt": reference.encode("Once upon a time"), "max_tokens": 12, "logprobs": 2, **LONG, **GREEDY}
    whole = client(server).completions.create(**kwargs).choices[0].logprobs
    joined: dict[str, list] = {}
    for chunk in client(server).completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                joined[key] = joined.get(key, []) + values
    assert joined == whole.model_dump() and whole.text_offset[-1] > 0


def test_stop_strings_cut_the_text(server, reference):
    prompt = reference.encode("Hello world")
    (result,) = reference.generate([prompt], SamplingParams(16, ignore_eos=True))
    full = text_of(reference, result.token_ids)
    stop = full[3:5]
    out = client(server).completions.create(prompt=prompt, max_tokens=16, stop=[stop], **LONG, **GREEDY)
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    chunks = client(server).completions.create(prompt=prompt, max_tokens=16, stop=[stop], stream=True, **LONG, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]


def test_penalties_reach_the_engine_and_mtp_keeps_them(server, mtp_server, reference):
    """presence / frequency penalties and logit_bias (OpenAI fields) and repetition_penalty (vLLM's extension): the
    engine's own tokens for those parameters, the same with MTP on."""
    prompt = reference.encode("Once upon a time")
    penalties = {"presence_penalty": 0.8, "frequency_penalty": 1.5}
    (plain,) = reference.generate([prompt], SamplingParams(24, ignore_eos=True))
    bias = {plain.token_ids[1]: -100.0, 42: 2.0}
    kwargs = {"prompt": prompt, "max_tokens": 24, **GREEDY, **penalties}
    kwargs["logit_bias"] = {str(token): value for token, value in bias.items()}
    extra = {"extra_body": {"ignore_eos": True, "repetition_penalty": 1.3, "min_tokens": 3}}
    answers = [client(live).completions.create(**kwargs, **extra).choices[0].text for live in (server, mtp_server)]
    params = SamplingParams(24, ignore_eos=True, repetition_penalty=1.3, logit_bias=bias, min_tokens=3, **penalties)
    (result,) = reference.generate([prompt], params)
    assert answers == [text_of(reference, result.token_ids)] * 2
    assert plain.token_ids != result.token_ids and plain.token_ids[1] not in result.token_ids


def test_api_key_guards_v1_and_leaves_health_metrics_version_open(keyed_server):
    with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
        client(keyed_server).completions.create(prompt=[1, 2], max_tokens=2, **GREEDY)
    keyed = openai.OpenAI(base_url=keyed_server.url, api_key="s3cret", max_retries=0)
    assert len(keyed.completions.create(prompt=[1, 2], max_tokens=2, **LONG, **GREEDY).choices[0].text) > 0
    assert httpx.get(keyed_server.url + "/models").status_code == 401
    assert httpx.get(keyed_server.base + "/health").status_code == 200
    assert httpx.get(keyed_server.base + "/metrics").status_code == 200
    assert httpx.get(keyed_server.base + "/version").json() == {"version": qwen_mtp.__version__}


def test_generation_config_supplies_the_sampling_fields_a_request_leaves_out(keyed_server, reference):
    """The checkpoint's generation_config.json says top_k 1: a request without top_k samples from one token (the
    greedy one, at any temperature); a request's own top_k wins."""
    keyed = openai.OpenAI(base_url=keyed_server.url, api_key="s3cret", max_retries=0)
    prompt = [5, 6, 7, 8]
    (greedy,) = reference.generate([prompt], SamplingParams(12, ignore_eos=True))
    out = keyed.completions.create(model="qwen-mtp", prompt=prompt, max_tokens=12, seed=3, **LONG)
    assert out.choices[0].text == text_of(reference, greedy.token_ids)
    wide = keyed.completions.create(model="qwen-mtp", prompt=prompt, max_tokens=12, seed=3,
                                    extra_body={"ignore_eos": True, "top_k": 0})  # fmt: skip
    assert wide.choices[0].text != out.choices[0].text  # T = 0.9 over the whole vocabulary


def test_seeded_sampling_is_reproducible(server):
    kwargs = {"model": "qwen-mtp", "prompt": [1, 2, 3], "max_tokens": 12, "temperature": 1.0, "seed": 7, **LONG}
    a, b = (client(server).completions.create(**kwargs).choices[0].text for _ in range(2))
    other = client(server).completions.create(**(kwargs | {"seed": 8})).choices[0].text
    assert a == b and len(a) > 0
    assert other != a  # 12 sampled tokens at T = 1 over the tiny vocabulary: a collision is vanishingly rare


def test_every_request_kind_at_once_answers_the_same_with_mtp(server, mtp_server, reference):
    """Concurrent requests of every kind the API takes (streamed and whole; stop strings and stop token ids that
    MTP's several tokens a step can straddle; logprobs with their offsets; n = 2 seeded sampling; penalties and
    logit bias; min_tokens; echo; chat), some clients hanging up mid-stream: every answer that completes is the
    plain server's, field for field, and both servers end with every page free."""
    rng = random.Random(5)
    texts = ["Hello world! How are you", "Once upon a time", "def add(a, b):", "The quick brown fox", "1, 2, 3,"]
    stops = [text_of(reference, reference.generate([reference.encode(t)], SamplingParams(12))[0].token_ids)[2:4]
             for t in texts]  # fmt: skip
    requests = []
    for _ in range(24):
        body = {"model": "qwen-mtp", "prompt": reference.encode(rng.choice(texts)), "max_tokens": rng.randint(1, 20)}
        body["temperature"], body["seed"] = (0.8, rng.randrange(1000)) if rng.random() < 0.4 else (0, None)
        body["n"] = 2 if body["temperature"] and rng.random() < 0.5 else 1
        if rng.random() < 0.4:
            body["stop"] = [rng.choice(stops)]
        if rng.random() < 0.2:
            body["stop_token_ids"] = [rng.choice(body["prompt"])]
        if rng.random() < 0.4:
            body["logprobs"] = 2
        if rng.random() < 0.3:
            body |= {"presence_penalty": 0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.2}
        if rng.random() < 0.2:
            body["logit_bias"] = {str(rng.choice(body["prompt"])): 3.0}
        if rng.random() < 0.2:
            body["min_tokens"] = min(3, body["max_tokens"])
        body["ignore_eos"] = rng.random() < 0.5
        stream = rng.random() < 0.5
        if rng.random() < 0.25:  # a chat completion: the prompt's text as the user's message
            body["messages"] = [{"role": "user", "content": reference.decode(body.pop("prompt"))}]
            if body.pop("logprobs", None):
                body |= {"logprobs": True, "top_logprobs": 2}
        elif not stream and rng.random() < 0.15:
            body["echo"] = True
        requests.append((body, stream, stream and rng.random() < 0.2))  # (body, streamed, hung up early)

    def fields(choice: dict) -> tuple[str, dict | None]:
        """A choice's (or a chunk's) text and log-probabilities, completions or chat."""
        if "text" in choice:
            return choice["text"], choice["logprobs"]
        message = choice.get("message") or choice.get("delta") or {}
        return message.get("content") or "", choice.get("logprobs")

    async def one(c: httpx.AsyncClient, live: LiveServer, body: dict, stream: bool, hang_up: bool):
        url = live.url + ("/chat/completions" if "messages" in body else "/completions")
        if not stream:
            answer = (await c.post(url, json=body, timeout=60)).json()
            return [(ch["index"], *fields(ch), ch["finish_reason"]) for ch in answer["choices"]]
        parts: dict[int, list] = {}
        async with c.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for ch in json.loads(line[6:])["choices"]:
                    text, logprobs = fields(ch)
                    part = parts.setdefault(ch["index"], ["", None, None])
                    part[0] += text
                    if logprobs:  # chunks split where steps end, which MTP moves: compare them joined
                        part[1] = {key: (part[1] or {}).get(key, []) + value for key, value in logprobs.items()}
                    part[2] = ch["finish_reason"] or part[2]
                if hang_up:
                    return None  # the connection closes: the server cancels the request
        return sorted((index, *part) for index, part in parts.items())

    async def answers(live: LiveServer):
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(one(c, live, *request) for request in requests))

    plain, mtp = asyncio.run(answers(server)), asyncio.run(answers(mtp_server))
    assert sum(a is None for a in plain) >= 1 and sum(a is not None for a in plain) >= 16
    for i, (want, got) in enumerate(zip(plain, mtp, strict=True)):
        if want is not None:  # a hung-up stream has no answer to compare
            assert got == want, f"request {i} ({requests[i][0]}, streamed {requests[i][1]}) differs with MTP"
    server.wait_all_free()
    mtp_server.wait_all_free()


def test_an_engine_loop_that_breaks_stops_the_server_instead_of_hanging(checkpoint):
    """Past a failed step (which ends only its requests), an error in the engine loop leaves nothing to step the
    engine: the running request ends with an error, and the server stops (`qwen-mtp serve` then exits 2)."""
    live = LiveServer.from_recipe(tiny_recipe(checkpoint()))
    with live:
        loop = live.server.config.app.state.engine_loop

        def broken_stats():
            raise RuntimeError("the loop's own bug")

        live.engine.stats = broken_stats  # runs after every step, outside the step's own error handling
        response = httpx.post(live.url + "/completions", json={"prompt": [1, 2], "max_tokens": 50, **GREEDY})
        assert response.status_code == 500
        live.thread.join(10)
        assert not live.thread.is_alive() and isinstance(loop.failed, RuntimeError)
