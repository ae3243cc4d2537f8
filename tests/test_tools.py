"""Tool calls (`server.tool_call_parser: qwen3_coder`): Qwen3.5's XML calls out of an answer as OpenAI `tool_calls`,
the same whole and streamed (text split anywhere), arguments typed by the tool's schema, what is not a complete call
left as content; the chat response and its stream chunks (`finish_reason` "tool_calls", call indices); and through
the server: tools and earlier calls reach the chat template, a request with tools needs the parser, and a forced
tool choice is refused."""

from __future__ import annotations

import itertools
import json
import random

import httpx
import openai
import pytest
from serve_helpers import LiveServer, tiny_recipe

from qwen_mtp.serve import responses as shape
from qwen_mtp.serve.app import _Api
from qwen_mtp.serve.text import TextAssembler
from qwen_mtp.serve.tools import ToolCallSplitter

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "ratio": {"type": "number"},
                "extra": {"type": "object"},
                "tags": {"type": ["array", "null"]},
            },
        },
    },
}


def call(name: str, **params: str) -> str:
    inside = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inside}</function>\n</tool_call>"


ANSWER = "Let me look.\n\n" + call("get_weather", city="Paris", days="3") + "\n" + call("get_weather", city="Rome")


def test_calls_typed_by_the_schema_and_the_rest_as_content():
    text = "Sure.\n" + call("get_weather", city="  Oslo", days="4", metric="True", ratio="0.5", extra='{"a": [1]}',
                            tags="null") + call("other", x="7")  # fmt: skip
    content, calls = ToolCallSplitter([WEATHER]).split(text)
    assert content == "Sure."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "other"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"city": "  Oslo", "days": 4, "metric": True, "ratio": 0.5, "extra": {"a": [1]}, "tags": None}
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": "7"}  # no schema: strings
    assert calls[0]["type"] == "function" and calls[0]["id"] != calls[1]["id"]
    bad = call("get_weather", days="three")
    assert json.loads(ToolCallSplitter([WEATHER]).split(bad)[1][0]["function"]["arguments"]) == {"days": "three"}


@pytest.mark.parametrize(
    "text,content,names",
    [
        (ANSWER, "Let me look.", ["get_weather", "get_weather"]),
        ("No tools needed: 4.", "No tools needed: 4.", []),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
            [],
        ),  # fmt: skip
        ("a <tool_call>not a call</tool_call> b", "a <tool_call>not a call</tool_call> b", []),
        ("<tool_cal", "<tool_cal", []),
    ],
)
def test_whole_and_streamed_answers_split_alike(text, content, names):
    whole = ToolCallSplitter([WEATHER]).split(text)
    assert whole[0] == content and [c["function"]["name"] for c in whole[1]] == names
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        splitter, pieces = ToolCallSplitter([WEATHER]), []
        for start, end in itertools.pairwise((0, *cuts, len(text))):
            pieces.append(splitter.push(text[start:end]))
        pieces.append(splitter.finish())
        streamed = "".join(c for c, _ in pieces)
        calls = [c for _, cs in pieces for c in cs]
        assert (streamed.strip() if calls else streamed) == (content or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole[1]
        ]


def choice_with(text: str, finish: str) -> shape.Choice:
    choice = shape.Choice(0, [1], TextAssembler(lambda ids: text[: len(ids) * 7]))
    choice.tools = ToolCallSplitter([WEATHER])
    choice.add(list(range(len(text) // 7 + 1)), None)
    choice.end(finish, None)
    return choice


def test_chat_response_and_stream_chunks_carry_the_calls():
    row = shape.chat_choice(choice_with(ANSWER, "stop"), lambda ids: "", False)
    assert row["finish_reason"] == "tool_calls" and row["message"]["content"] == "Let me look."
    assert [c["function"]["name"] for c in row["message"]["tool_calls"]] == ["get_weather"] * 2
    assert shape.chat_choice(choice_with(ANSWER, "length"), lambda ids: "", False)["finish_reason"] == "length"
    _, chunk = _Api._chat_chunks(object.__new__(_Api), False)
    choice = shape.Choice(0, [1], TextAssembler(lambda ids: ""))
    choice.tools = ToolCallSplitter([WEATHER])
    pieces = [ANSWER[i : i + 9] for i in range(0, len(ANSWER), 9)]
    rows = [chunk(choice, piece, None, None) for piece in pieces] + [chunk(choice, "", None, "stop")]
    deltas = [r["delta"] for r in rows]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and rows[-1]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me look."


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    with LiveServer.from_recipe(tiny_recipe(chat_checkpoint, "server.tool_call_parser=qwen3_coder")) as live:
        yield live


def test_tools_and_earlier_calls_reach_the_template(server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    body = {"messages": messages, "tools": [WEATHER]}
    tokens = httpx.post(server.base + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n# Tools") and "get_weather<|im_end|>" in text.split("user")[0]
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text and "tool\nsunny" in text
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    out = client.chat.completions.create(model="qwen-mtp", messages=messages, tools=[WEATHER], max_tokens=6,
                                         temperature=0)  # fmt: skip
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None  # no call written
    assert out.usage.prompt_tokens == len(tokens)
    for choice, message in (({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
                            ({"type": "function"}, "names a function as"),
                            ("required", "not be combined")):  # fmt: skip
        extra = {"tool_choice": choice, "max_tokens": 2, "response_format": {"type": "json_object"}}
        response = httpx.post(server.url + "/chat/completions", json=body | extra)
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    response = httpx.post(server.url + "/chat/completions", json={"messages": messages, "tool_choice": "required"})
    assert response.status_code == 400 and "needs tools" in response.json()["error"]["message"]
    bad = messages[:1] + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]  # fmt: skip
    response = httpx.post(server.url + "/chat/completions", json={"messages": bad, "max_tokens": 2})
    assert response.status_code == 400 and "arguments are not JSON" in response.json()["error"]["message"]


NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
LATER = {"type": "function", "function": {"name": "later", "parameters": {"type": "object", "properties": {}}}}


def matcher_for(checkpoint, grammar):
    import llguidance
    from helpers import reference_lltokenizer

    tokenizer, lltokenizer = reference_lltokenizer(checkpoint)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), lltokenizer) == ""
    return lambda text: _consumes(llguidance.LLMatcher(lltokenizer, llguidance.LLMatcher.grammar_from_lark(grammar)),
                                  tokenizer.encode(text, add_special_tokens=False))  # fmt: skip


def _consumes(matcher, ids) -> tuple[bool, bool]:
    """(every token consumed, the grammar complete there)."""
    return matcher.try_consume_tokens(ids) == len(ids), matcher.is_accepting()


def test_call_grammar_takes_the_tools_calls_and_nothing_else(chat_checkpoint):
    from qwen_mtp.serve.tools import call_grammar

    tools = [WEATHER, NOW]
    accepts = matcher_for(chat_checkpoint, call_grammar(tools))
    weather = call("get_weather", city="Paris", days="3")
    assert accepts(weather) == (True, True) and accepts(call("now")) == (True, True)
    assert accepts(weather + "\n\n" + call("now")) == (True, True)  # parallel calls
    assert accepts(call("get_weather", city="a\n</param")) == (True, True)  # a value runs to "\n</parameter>\n"
    assert accepts(call("other"))[0] is False and accepts(call("get_weather", town="x"))[0] is False
    assert accepts(call("now", x="1"))[0] is False  # "properties": {}: no parameter
    assert accepts("Sure: " + call("now"))[0] is False and accepts(call("now")[:-3]) == (True, False)
    for text in (weather, call("now")):
        parsed = ToolCallSplitter(tools).split(text)[1]
        assert [c["function"]["name"] for c in parsed] == [text.split("=")[1].split(">")[0]]
    one = matcher_for(chat_checkpoint, call_grammar(tools, "now", parallel=False))
    assert one(call("now")) == (True, True) and one(weather)[0] is False
    assert one(call("now") + "\n" + call("now"))[0] is False


def test_forced_tool_choice_writes_calls_with_mtp_as_without(chat_checkpoint):
    """A named function: exactly its call; "required": calls of the tools only, one with parallel_tool_calls false;
    finish_reason "tool_calls"; MTP on gives MTP-off's answer."""
    settings = ("server.tool_call_parser=qwen3_coder",)
    with (
        LiveServer.from_recipe(tiny_recipe(chat_checkpoint, *settings)) as plain,
        LiveServer.from_recipe(tiny_recipe(chat_checkpoint, *settings, "mtp.enabled=true", "mtp.k=3")) as mtp,
    ):
        clients = [openai.OpenAI(base_url=s.url, api_key="none", max_retries=0) for s in (plain, mtp)]
        base = {"model": "qwen-mtp", "messages": [{"role": "user", "content": "Time?"}], "tools": [NOW, LATER],
                "temperature": 0, "max_tokens": 64}  # fmt: skip
        cases = [({"tool_choice": {"type": "function", "function": {"name": "later"}}}, ["later"]),
                 ({"tool_choice": "required", "parallel_tool_calls": False}, None)]  # fmt: skip
        for extra, names in cases:
            answers = [c.chat.completions.create(**base, **extra).choices[0] for c in clients]
            choice = answers[0]
            called = [call.function.name for call in choice.message.tool_calls]
            assert choice.finish_reason == "tool_calls" and len(called) == 1 and called[0] in ("now", "later")
            assert names is None or called == names
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {}
            assert answers[1].message.tool_calls[0].function.name == called[0]
            assert answers[1].message.content == choice.message.content


def test_tools_need_the_parser(chat_checkpoint):
    with LiveServer.from_recipe(tiny_recipe(chat_checkpoint)) as live:
        body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "max_tokens": 2}
        response = httpx.post(live.url + "/chat/completions", json=body)
        assert response.status_code == 400 and "server.tool_call_parser" in response.json()["error"]["message"]
        ok = httpx.post(live.url + "/chat/completions", json=body | {"tool_choice": "none", "temperature": 0})
        assert ok.status_code == 200
