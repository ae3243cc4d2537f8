"""Structured outputs through the server and the real `openai` client: `response_format` (json_object, json_schema,
text) and vLLM's `structured_outputs` (regex, choice, json, grammar), whole and streamed, MTP on giving MTP-off's
text; bad grammars and contradictory fields are 400s naming the problem, and the server keeps serving."""

from __future__ import annotations

import json
import re

import openai
import pytest
from serve_helpers import LiveServer, tiny_recipe

MESSAGES = [{"role": "user", "content": "Pick one."}]
ENUM = {"type": "string", "enum": ["red", "green", "blue"]}


@pytest.fixture(scope="module")
def servers(chat_checkpoint):
    """MTP off and MTP on (K=3, head drafts) on the tiny chat checkpoint."""
    with (
        LiveServer.from_recipe(tiny_recipe(chat_checkpoint)) as plain,
        LiveServer.from_recipe(tiny_recipe(chat_checkpoint, "mtp.enabled=true", "mtp.k=3")) as mtp,
    ):
        yield plain, mtp


def clients(servers):
    return [openai.OpenAI(base_url=s.url, api_key="none", max_retries=0) for s in servers]


def chat(client, stream: bool = False, **kwargs) -> tuple[str, str]:
    """(content, finish_reason) of one greedy chat completion, whole or streamed."""
    args = {"model": "qwen-mtp", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


CASES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": ENUM}}},
     lambda text: json.loads(text) in ENUM["enum"]),
    ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, lambda text: text in ("yes", "no")),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]{3}"}}}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"extra_body": {"structured_outputs": {"json": {"type": "boolean"}}}},
     lambda text: json.loads(text) in (True, False)),
    ({"extra_body": {"structured_outputs": {"grammar": 'start: "a" ("b" | "c")'}}}, lambda text: text in ("ab", "ac")),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)))
def test_structured_chat_whole_streamed_and_with_mtp(servers, case):
    kwargs, valid = CASES[case]
    plain, mtp = clients(servers)
    text, reason = chat(plain, **kwargs)
    assert reason == "stop" and valid(text), text
    assert chat(plain, stream=True, **kwargs) == (text, reason)
    assert chat(mtp, **kwargs) == (text, reason)


def test_json_object_and_text_formats(servers):
    plain, mtp = clients(servers)
    free, _ = chat(plain)
    assert chat(plain, response_format={"type": "text"})[0] == free
    text, reason = chat(plain, response_format={"type": "json_object"}, max_tokens=40)
    assert text.lstrip().startswith("{")  # an object, complete or cut at max_tokens
    assert reason == "length" or isinstance(json.loads(text), dict)
    assert chat(mtp, response_format={"type": "json_object"}, max_tokens=40) == (text, reason)


def test_completions_take_structured_outputs(servers):
    plain, _ = clients(servers)
    args = {"model": "qwen-mtp", "prompt": "Colour:", "max_tokens": 8, "temperature": 0}
    extension = {"structured_outputs": {"choice": ["red", "green"]}}
    choice = plain.completions.create(**args, extra_body=extension).choices[0]
    assert choice.text in ("red", "green") and choice.finish_reason == "stop"


def test_bad_structured_requests_are_400s_and_the_server_serves_on(servers):
    plain, _ = clients(servers)
    bad = [
        ({"extra_body": {"structured_outputs": {"grammar": "start: foo"}}}, "unknown name"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one of"),
        ({"extra_body": {"structured_outputs": {"regex": "a"}}, "response_format": {"type": "json_object"}},
         "not both"),
        ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
        ({"extra_body": {"structured_outputs": {"yaml": "a"}}}, "yaml"),
    ]  # fmt: skip
    for kwargs, message in bad:
        with pytest.raises(openai.BadRequestError, match=message):
            chat(plain, **kwargs)
    assert chat(plain, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})[1] == "stop"
    servers[0].wait_all_free()


def test_concurrent_structured_requests_get_their_own_answers(servers):
    """Requests with different structures (and none) in flight together on the MTP server, some streamed: each gets
    the answer it gets alone (the masks are per request and per position; the batch changes no token)."""
    from concurrent.futures import ThreadPoolExecutor

    _, mtp = clients(servers)
    kinds = [kwargs for kwargs, _ in CASES] + [{}, {"response_format": {"type": "json_object"}}]
    alone = [chat(mtp, **kwargs) for kwargs in kinds]
    with ThreadPoolExecutor(len(kinds)) as pool:
        together = list(pool.map(lambda i: chat(mtp, stream=i % 2 == 1, **kinds[i]), range(len(kinds))))
    assert together == alone
    servers[1].wait_all_free()
