"""`server.reasoning_parser: qwen3`: a chat answer's thinking apart from its content, the same whole and streamed
(text split anywhere, tags across pieces), whether the prompt opened the think block or the answer does; and
through the server: `reasoning_content` in answers and stream deltas, with `chat_template_kwargs.enable_thinking`."""

from __future__ import annotations

import itertools

import openai
import pytest
from serve_helpers import LiveServer, tiny_recipe

from qwen_mtp.serve.reasoning import ReasoningSplitter, opens_thinking

CASES = [
    # (thinking opened by the prompt, answer, reasoning, content)
    (True, "Let me see.</think>\n\nThe answer is 4.", "Let me see.", "The answer is 4."),
    (True, "</think>\n\nDirect.", None, "Direct."),
    (True, "cut off while thinking <", "cut off while thinking <", None),
    (False, "<think>hmm, 2 + 2</think>\n4", "hmm, 2 + 2", "4"),
    (False, "Just an answer with </think> inside", None, "Just an answer with </think> inside"),
    (False, "<thin air", None, "<thin air"),
    (False, "", None, None),
]


@pytest.mark.parametrize("thinking,answer,reasoning,content", CASES)
def test_whole_and_streamed_answers_split_alike(thinking, answer, reasoning, content):
    assert ReasoningSplitter(thinking).split(answer) == (reasoning, content)
    for cuts in itertools.combinations(range(1, len(answer)), min(3, max(len(answer) - 1, 0))):
        splitter, pieces = ReasoningSplitter(thinking), []
        for start, end in itertools.pairwise((0, *cuts, len(answer))):
            pieces.append(splitter.push(answer[start:end]))
        pieces.append(splitter.finish())
        streamed = ("".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces) or None)
        assert streamed == (reasoning, content), cuts


def test_the_prompt_says_whether_the_answer_starts_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    with LiveServer.from_recipe(tiny_recipe(chat_checkpoint, "server.reasoning_parser=qwen3")) as live:
        yield live


def test_reasoning_content_through_the_server(server):
    """The tiny model never writes `</think>`: with thinking on, its whole answer is reasoning, streamed as
    reasoning_content deltas; with thinking off (the template closes an empty block) it is all content."""
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    kwargs = {"model": "qwen-mtp", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    thinking = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    whole = client.chat.completions.create(**kwargs, **thinking).choices[0].message
    assert whole.content is None and len(whole.reasoning_content) > 0
    chunks = list(client.chat.completions.create(**kwargs, **thinking, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    assert not any(d.content for d in deltas)
    plain = client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning_content", None) is None


def test_structured_outputs_apply_after_the_thinking(server, chat_checkpoint):
    """With the parser on and thinking on, the structure starts after `</think>` (the grammar leaves the thinking
    free): the tiny model thinks on to max_tokens; with thinking off its content is one of the choices. The grammar
    itself: any text, `</think>`, newlines, then the structure."""
    import llguidance
    from helpers import reference_lltokenizer

    from qwen_mtp import StructuredOutput
    from qwen_mtp.engine.grammar import grammar_text

    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    kwargs = {"model": "qwen-mtp", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}
    structure = {"structured_outputs": {"choice": ["yes", "no"]}}
    thinking = client.chat.completions.create(
        **kwargs, extra_body=structure | {"chat_template_kwargs": {"enable_thinking": True}}
    ).choices[0]
    assert thinking.finish_reason == "length" and thinking.message.content is None
    assert len(thinking.message.reasoning_content) > 0
    direct = client.chat.completions.create(
        **kwargs, extra_body=structure | {"chat_template_kwargs": {"enable_thinking": False}}
    ).choices[0]
    assert direct.finish_reason == "stop" and direct.message.content in ("yes", "no")
    tokenizer, lltokenizer = reference_lltokenizer(chat_checkpoint)
    grammar = grammar_text(StructuredOutput(choice=["yes", "no"], after_thinking=True))
    for text, complete in (("hm, </thi> no.</think>\n\nyes", True), ("</think>no", True), ("yes", False)):
        matcher = llguidance.LLMatcher(lltokenizer, grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting() is complete, text
