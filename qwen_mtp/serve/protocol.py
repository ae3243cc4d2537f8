"""The OpenAI request bodies the server accepts (pydantic), and their mapping onto `SamplingParams`.

Unknown fields are refused (422 -> 400 naming the field) rather than ignored, so a misspelt option never
silently changes what a client gets. Extensions beyond the OpenAI API follow vLLM's names: `top_k`, `min_p`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs`, `structured_outputs`.
`logit_bias` keys are token ids written as strings, as JSON objects need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from qwen_mtp.engine.params import MAX_LOGPROBS, SamplingParams, StructuredOutput
from qwen_mtp.errors import RecipeError, RequestError
from qwen_mtp.serve.tools import call_grammar

Number = StrictInt | StrictFloat
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """The OpenAI API's `response_format`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


class _Sampling(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    temperature: Number | None = None  # None: the OpenAI default, 1.0
    top_p: Number | None = None
    top_k: StrictInt | None = None  # 0 or -1: off
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Number | None = None  # None: 0, off
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None  # None: 1, off
    logit_bias: dict[StrictStr, Number] | None = None  # token id (as a JSON key: a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM's name)

    def structured(self, after_thinking: bool = False) -> StructuredOutput | None:
        """What the output must match: `response_format` (json_object, json_schema; text: nothing) or
        `structured_outputs`, not both; `after_thinking`: from the end of the think block the prompt opened."""
        form, extension = self.response_format, self.structured_outputs
        if form is not None and form.type != "text" and extension is not None:
            raise RequestError("give response_format or structured_outputs, not both")
        if extension is not None:
            return StructuredOutput(
                json_schema=extension.json_, regex=extension.regex, choice=extension.choice,
                grammar=extension.grammar, json_object=bool(extension.json_object),
                any_whitespace=not extension.disable_any_whitespace, after_thinking=after_thinking,
            )  # fmt: skip
        if form is None or form.type == "text":
            return None
        if form.type == "json_object":
            return StructuredOutput(json_object=True, after_thinking=after_thinking)
        if form.json_schema is None:
            raise RequestError('response_format of type "json_schema" needs its json_schema: {"name", "schema"}')
        schema = form.json_schema.json_schema
        return StructuredOutput(json_schema=schema if schema is not None else {}, after_thinking=after_thinking)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        defaults: dict | None = None,
        after_thinking: bool = False,
    ) -> SamplingParams:
        """The engine's parameters for one choice (`max_tokens` already resolved; 0 runs one token, dropped); a
        sampling field the request leaves out takes `defaults` (`generation_defaults`), else the OpenAI API's;
        `after_thinking`: a structured output applies after the think block the prompt opened."""
        defaults = defaults or {}

        def given(name: str, default: float) -> float:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, default)

        stop = self.stop if isinstance(self.stop, list) else [self.stop] if self.stop is not None else []
        return SamplingParams(
            max_new_tokens=max(max_tokens, 1),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            temperature=given("temperature", 1.0),
            top_k=max(0, given("top_k", 0)),  # -1: off
            top_p=given("top_p", 1.0),
            min_p=given("min_p", 0.0),
            seed=self.seed,
            repetition_penalty=given("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=_token_biases(self.logit_bias or {}),
            stop=tuple(stop),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=self.structured(after_thinking),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(checkpoint: Path | None) -> dict[str, float]:
    """The sampling defaults a checkpoint's `generation_config.json` sets (its `GENERATION_KEYS`), as vLLM applies
    them to requests that leave those fields out; {} without the file. A value that is not a number is a
    `RecipeError` naming it (the server does not start with defaults it cannot use)."""
    file = None if checkpoint is None else Path(checkpoint) / "generation_config.json"
    if file is None or not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecipeError(f"server.generation_defaults: cannot read {file}: {err}") from None
    defaults = {}
    for key in GENERATION_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int if key == "top_k" else int | float):
            kind = "an integer" if key == "top_k" else "a number"
            raise RecipeError(f"server.generation_defaults: {file} has {key}={value!r}, not {kind}")
        defaults[key] = value
    return defaults


def _token_biases(given: dict[str, float]) -> dict[int, float]:
    """`logit_bias` with its keys (token ids written as JSON strings) as ints; `RequestError` for another key."""
    bad = [key for key in given if not key.strip().isdigit()]
    if bad:
        raise RequestError(f'logit_bias keys must be token ids ("123"), got {bad[0][:40]!r}')
    return {int(key): bias for key, bias in given.items()}


class CompletionRequest(_Sampling):
    """POST /v1/completions: `prompt` is text, token ids, or a list of either (one choice set per prompt)."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        if not prompt:
            raise RequestError("prompt is empty: give text, token ids, or a non-empty list of either")
        return list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    arguments: StrictStr  # a JSON object, as the OpenAI API writes it


class ToolCall(BaseModel):
    """A tool call an earlier assistant message made (the conversation's history)."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: StrictStr | None = None  # tool: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it; a tool call's arguments as an object (Qwen's templates iterate
        over them), as vLLM hands them over."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type, "function": {"name": call.function.name,
                                                                "arguments": _arguments(call.function)}}
                for call in self.tool_calls
            ]  # fmt: skip
        return message


def _arguments(function: FunctionCall) -> dict[str, Any]:
    try:
        arguments = json.loads(function.arguments)
    except json.JSONDecodeError as err:
        raise RequestError(f"tool call {function.name!r}: arguments are not JSON: {err}") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"tool call {function.name!r}: arguments must be a JSON object")
    return arguments


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionTool


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """A request's `tools` as the chat template reads them (None without any)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: `messages` go through the checkpoint's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # extension (vLLM's and SGLang's name): more variables for the chat template, e.g. Qwen's enable_thinking
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the answer is searched for tool calls: tools given and `tool_choice` not "none"."""
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise RequestError(f"tool_choice {self.tool_choice!r} needs tools")
        named = self.forced_function  # checked here: a named function must be among the tools
        return bool(self.tools) and (named is not None or self.tool_choice != "none")

    @property
    def forced_function(self) -> str | None:
        """The function `tool_choice` names (`{"type": "function", "function": {"name": ...}}`), else None."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return None
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError('tool_choice names a function as {"type": "function", "function": {"name": ...}}')
        if name not in {tool.function.name for tool in self.tools or ()}:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools")
        return name

    def structured(self, after_thinking: bool = False) -> StructuredOutput | None:
        """`tool_choice` "required" or a named function: the answer is decoded under the grammar of tool calls
        (`tools.call_grammar`: one call of the named function, one or more calls of any tool when required,
        unless `parallel_tool_calls` is false); else `_Sampling.structured`."""
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        if not forced:
            return super().structured(after_thinking)
        if super().structured() is not None:
            raise RequestError("a forced tool_choice cannot be combined with response_format or structured_outputs")
        name = self.forced_function
        grammar = call_grammar(
            template_tools(self.tools), name, parallel=name is None and self.parallel_tool_calls is not False
        )
        return StructuredOutput(grammar=grammar, after_thinking=after_thinking)

    @property
    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: TokenIds
