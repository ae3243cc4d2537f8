"""Tool calls out of a chat answer (`server.tool_call_parser: qwen3_coder`): the XML that Qwen3.5's and
Qwen3-Coder's chat templates teach the model to write, as OpenAI `tool_calls`:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each parameter's text becomes a JSON value by the type the request's tool schema gives it (integer, number,
boolean, object, array, null; a string otherwise, or when the text does not parse as its type), as vLLM's
`qwen3_coder` parser does; `arguments` is the JSON object of them, as a string. The text outside the blocks is the
answer's content. A block the model did not close, or one without a function, stays content.

`ToolCallSplitter.push` takes the answer's (content) text as it becomes final and returns the content that became
final and the calls completed in it: a possible beginning of `<tool_call>` is held back until the next text decides
it, and a call is sent whole once its block closes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from qwen_mtp.serve.text import held_back

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def parse_call(block: str, schemas: dict[str, dict]) -> dict[str, Any] | None:
    """One `<tool_call>` block's inside as an OpenAI tool call (a new id), or None without a function in it."""
    found = _FUNCTION.search(block)
    if found is None:
        return None
    name = found.group(1).strip()
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments = {}
    for key, raw in _PARAMETER.findall(found.group(2)):
        key = key.strip()
        arguments[key] = _value(_trim(raw), properties.get(key) or {})
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def _trim(raw: str) -> str:
    """A parameter's text without the one newline the format puts on each side of it."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _value(text: str, schema: dict) -> Any:
    """`text` as the JSON type `schema` names (its first, for a list of types); the text itself if it does not
    parse so."""
    kind = schema.get("type")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    stripped = text.strip()
    if stripped == "null" and kind != "string":
        return None
    try:
        if kind in ("integer", "int"):
            return int(stripped)
        if kind in ("number", "float"):
            number = float(stripped)
            return (
                int(number) if number.is_integer() and "." not in stripped and "e" not in stripped.lower() else number
            )
        if kind in ("boolean", "bool"):
            if stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            return text
        if kind in ("object", "array", "dict", "list"):
            return json.loads(stripped)
    except (ValueError, json.JSONDecodeError):
        return text
    return text


def call_grammar(tools: list[dict], name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) of answers that are tool calls in this format and nothing else: calls
    of `name` only (or of any of `tools`), one or more (`parallel`) or exactly one. Each function's parameter names
    come from its schema's properties (any name when it gives none; no parameter for `"properties": {}`); a value
    is free text up to the first `\n</parameter>\n` (a lazy rule: its shortest match). What `tool_choice`
    "required" or a named function asks for, decoded under this grammar (`StructuredOutput.grammar`)."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}" if name is not None else "no tools")
    rules = []
    for i, function in enumerate(chosen):
        properties = (function.get("parameters") or {}).get("properties")
        head = json.dumps(f"{START}\n<function={function['name']}>\n")
        if properties == {}:
            rules.append(f'call{i}: {head} "</function>\\n{END}"')
            continue
        key = " | ".join(json.dumps(k) for k in properties) if properties else "/[^>\\n]+/"
        rules.append(f'call{i}: {head} param{i}* "</function>\\n{END}"')
        rules.append(f'param{i}: "<parameter=" ({key}) ">\\n" value')
    calls = " | ".join(f"call{i}" for i in range(len(chosen)))
    start = "start: call (/\\n*/ call)*" if parallel else "start: call"
    lines = [start, f"call: {calls}", *rules, "value[lazy]: /(?s:.*)\\n<\\/parameter>\\n/"]
    return "\n".join(lines)


class ToolCallSplitter:
    def __init__(self, tools: list[dict]):
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        self.pending = ""  # held back: a possible beginning of `<tool_call>`, or an open block
        self.calls: list[dict] = []  # every call parsed so far

    def push(self, text: str) -> tuple[str, list[dict]]:
        """The content and the completed calls that `text`, the answer's next final content, makes final."""
        return self._advance(self.pending + text, final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._advance(self.pending, final=True)

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer: (content without the calls, None if only whitespace is left), the calls."""
        content, calls = self.push(text)
        more, last = self.finish()
        content, calls = content + more, calls + last
        return (content.strip() if calls else content) or None, calls

    def _advance(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.pending, content, calls = "", "", []
        while text:
            start = text.find(START)
            if start < 0:
                held = 0 if final else held_back(text, (START,))
                content += text[: len(text) - held]
                self.pending = text[len(text) - held :]
                break
            content += text[:start]
            end = text.find(END, start)
            if end < 0:  # an open block: wait for its end, or leave it as text at the answer's end
                if final:
                    content += text[start:]
                else:
                    self.pending = text[start:]
                break
            call = parse_call(text[start + len(START) : end], self.schemas)
            if call is None:
                content += text[start : end + len(END)]
            else:
                calls.append(call)
            text = text[end + len(END) :]
        if self.calls or calls:  # between and after calls only whitespace is expected: it is not content
            content = content if content.strip() else ""
        self.calls += calls
        return content, calls
