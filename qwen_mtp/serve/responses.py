"""OpenAI response bodies: one `Choice` per engine request collects its tokens and text; the functions here
shape choices into completion / chat completion objects and stream chunks, log-probabilities included."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qwen_mtp.engine.update import TokenLogprob
from qwen_mtp.serve.reasoning import ReasoningSplitter
from qwen_mtp.serve.text import TextAssembler
from qwen_mtp.serve.tools import ToolCallSplitter

Decode = Callable[[list[int]], str | None]


@dataclass
class Choice:
    """One answer: the engine request behind it, the text so far, and what it reports when done."""

    index: int
    prompt: list[int]
    assembler: TextAssembler
    echo: str = ""  # the prompt text, returned before the output (completions' `echo`)
    drop_output: bool = False  # max_tokens 0: the one token the engine ran is not part of the answer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    reasoning: ReasoningSplitter | None = None  # chat with `server.reasoning_parser`: thinking apart from content
    tools: ToolCallSplitter | None = None  # chat with tools: the calls apart from the content
    streamed_offset: int = 0  # where the next streamed chunk's `text_offset` starts: its tokens' texts so far

    def add(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> str:
        """Take new tokens; returns the text that became final."""
        if self.drop_output:
            return ""
        self.token_ids += tokens
        self.logprobs += logprobs or []
        return self.assembler.push(tokens)

    def end(self, finish_reason: str, prompt_logprobs: list[TokenLogprob | None] | None) -> str:
        self.finish_reason = "length" if self.drop_output and finish_reason != "timeout" else finish_reason
        self.prompt_logprobs = prompt_logprobs
        return "" if self.drop_output else self.assembler.finish()

    @property
    def text(self) -> str:
        return self.assembler.text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(kind: str, response_id: str, model: str, choices: list[dict], **more: Any) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **more}


# ---- completions -------------------------------------------------------------------------------------------
def completion_choice(choice: Choice, decode: Decode, want_logprobs: bool) -> dict[str, Any]:
    entries: list[TokenLogprob | None] = []
    if choice.echo or choice.prompt_logprobs:
        entries += _prompt_entries(choice)
    entries += choice.logprobs
    return {
        "index": choice.index,
        "text": choice.echo + choice.text,
        "logprobs": legacy_logprobs(entries, choice.prompt, decode) if want_logprobs else None,
        "finish_reason": choice.finish_reason,
    }


def _prompt_entries(choice: Choice) -> list[TokenLogprob | None]:
    if choice.prompt_logprobs is None:
        return [None] * len(choice.prompt)
    return list(choice.prompt_logprobs)


def legacy_logprobs(
    entries: list[TokenLogprob | None], prompt: list[int], decode: Decode, offset: int = 0
) -> dict[str, Any]:
    """The completions API's log-probabilities: parallel lists per token; None where a position has none (the
    first prompt token). A position without an entry takes its token from the prompt. `text_offset` counts the
    tokens' texts from `offset` (a streamed chunk's: the texts of the answer's tokens before it)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for i, entry in enumerate(entries):
        token_id = entry.token_id if entry is not None else prompt[i]
        text = decode([token_id]) or ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(entry.logprob if entry is not None else None)
        top_logprobs.append({decode([t]) or "": lp for t, lp in entry.top} if entry is not None else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def completion_chunk_choice(
    choice: Choice, text: str, logprobs: list[TokenLogprob] | None, decode: Decode, finish_reason: str | None
) -> dict[str, Any]:
    """A streamed chunk of a completion. Its `text_offset`s continue the choice's earlier chunks' (as in the whole
    answer), so they do not depend on where steps cut the stream: MTP emits several tokens a step."""
    shaped = legacy_logprobs(logprobs, [], decode, choice.streamed_offset) if logprobs else None
    if shaped is not None:
        choice.streamed_offset = shaped["text_offset"][-1] + len(shaped["tokens"][-1])
    return {"index": choice.index, "text": text, "logprobs": shaped, "finish_reason": finish_reason}


# ---- chat completions --------------------------------------------------------------------------------------
def chat_logprobs(entries: list[TokenLogprob], decode: Decode) -> dict[str, Any]:
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode([token_id]) or ""
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content}


def chat_choice(choice: Choice, decode: Decode, want_logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.reasoning is not None:
        message["reasoning_content"], message["content"] = choice.reasoning.split(choice.text)
    finish_reason = choice.finish_reason
    if choice.tools is not None:
        message["content"], calls = choice.tools.split(message["content"] or "")
        if calls:
            message["tool_calls"] = calls
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {
        "index": choice.index,
        "message": message,
        "logprobs": chat_logprobs(choice.logprobs, decode) if want_logprobs else None,
        "finish_reason": finish_reason,
    }


def chat_delta(choice: Choice, text: str, final: bool) -> dict[str, Any]:
    """A chat stream chunk's delta for `text`, the answer's next final text (`final`: its last): its thinking as
    `reasoning_content`, then the tool calls it completes (each whole, with its index among the answer's calls)
    apart from the `content`, by the choice's parsers."""
    reasoning, content, calls = "", text, []
    if choice.reasoning is not None:
        reasoning, content = choice.reasoning.push(text)
        if final:
            rest = choice.reasoning.finish()
            reasoning, content = reasoning + rest[0], content + rest[1]
    if choice.tools is not None:
        made = len(choice.tools.calls)  # calls sent in earlier chunks
        content, calls = choice.tools.push(content)
        if final:
            rest = choice.tools.finish()
            content, calls = content + rest[0], calls + rest[1]
        calls = [{"index": made + i, **call} for i, call in enumerate(calls)]
    delta = {"reasoning_content": reasoning} if reasoning else {}
    delta |= {"content": content} if content else {}
    return delta | ({"tool_calls": calls} if calls else {})


def chat_chunk_choice(
    choice: Choice, delta: dict[str, str], logprobs: list[TokenLogprob] | None, decode: Decode, finish: str | None
) -> dict[str, Any]:
    return {
        "index": choice.index,
        "delta": delta,
        "logprobs": chat_logprobs(logprobs, decode) if logprobs else None,
        "finish_reason": finish,
    }
