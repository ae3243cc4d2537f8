"""The OpenAI request bodies the server accepts (pydantic), and their mapping onto `SamplingParams`.

Unknown fields are refused (422 -> 400 naming the field) rather than ignored, so a misspelt option never
silently changes what a client gets. Extensions beyond the OpenAI API follow vLLM's names: `top_k`, `min_p`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs`. `logit_bias` keys are
token ids written as strings, as JSON objects need.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from qwen_mtp.engine.params import MAX_LOGPROBS, SamplingParams
from qwen_mtp.errors import RequestError

Number = StrictInt | StrictFloat
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


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

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The engine's parameters for one choice (`max_tokens` already resolved; 0 runs one token, dropped)."""
        stop = self.stop if isinstance(self.stop, list) else [self.stop] if self.stop is not None else []
        return SamplingParams(
            max_new_tokens=max(max_tokens, 1),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=_token_biases(self.logit_bias or {}),
            stop=tuple(stop),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: `messages` go through the checkpoint's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # extension (vLLM's and SGLang's name): more variables for the chat template, e.g. Qwen's enable_thinking
    chat_template_kwargs: dict[StrictStr, Any] | None = None

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


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: TokenIds
