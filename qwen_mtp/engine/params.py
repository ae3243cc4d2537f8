"""What a request asks of generation: `SamplingParams`, checked when made, and the check of prompt token ids.
Both raise `RequestError` with what was given, so a bad request fails at submit and allocates nothing."""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from qwen_mtp.errors import RequestError

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per position (the OpenAI API's bound)
MAX_LOGIT_BIAS = 100.0  # the OpenAI API's bound
MAX_REPETITION_PENALTY = 100.0  # past it every seen token is gone anyway; a bound keeps x / r and x * r finite


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    - `max_new_tokens`: the most tokens to generate (the request ends with finish_reason "length");
    - `min_tokens`: the fewest (vLLM's extension): the first `min_tokens` output tokens cannot be EOS or a
      `stop_token_ids` token (their logits are -inf there) and no stop string ends the request before them;
    - `ignore_eos`: keep going past the model's EOS tokens;
    - `stop_token_ids`: more tokens that end the request as EOS does (finish_reason "stop", the token included
      in the output), whether or not `ignore_eos` is set;
    - `temperature` (0 = greedy), `top_k` (0 = off), `top_p` (1.0 = off), `min_p` (0.0 = off): the sampling
      distribution at each position; `seed`: the request's noise (None: drawn from the engine's generator at
      submit and recorded, so the request can be replayed);
    - `repetition_penalty` (1.0 = off, > 0): every token of the prompt or the output so far has its logit
      divided by it where positive and multiplied by it otherwise (Hugging Face's and vLLM's rule);
      `presence_penalty` and `frequency_penalty` (0.0 = off, in [-2, 2] as in the OpenAI API): every token of
      the output so far has its logit lowered by `presence_penalty` once and by `frequency_penalty` per
      occurrence. They apply before temperature and the filters, greedy requests included;
    - `logit_bias`: {token id: bias in [-100, 100]} (or (id, bias) pairs) added to those tokens' logits at every
      position, before the penalties (the OpenAI API's field; -100 bans a token, 100 all but forces it);
    - `stop`: strings that end the request (finish_reason "stop"), checked on the detokenized output;
    - `logprobs`: report the chosen token's log-probability and the `logprobs` most likely tokens per position
      (None = off); `prompt_logprobs`: the same for every prompt position (None = off);
    - `structured`: a `StructuredOutput` the output must match (a JSON schema, any JSON object, a regular
      expression, one of a list of strings, or a Lark grammar): every token outside it has its logit at -inf,
      and the request ends ("stop") once the output is complete and nothing may follow (docs/sampling.md).
    """

    max_new_tokens: int = 32
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # added after the fields above, so that positional arguments keep their meaning
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not is_token_id(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {_given(self.max_new_tokens)}")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {_given(self.ignore_eos)}")
        stops = self.stop_token_ids
        if isinstance(stops, str | bytes) or not isinstance(stops, list | tuple | set | frozenset):
            raise RequestError(f"stop_token_ids must be a list of token ids, got {_given(stops)}")
        bad = [t for t in stops if not is_token_id(t) or t < 0]
        if bad:
            raise RequestError(f"stop_token_ids must be token ids (integers >= 0), got {_given(bad[0])}")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        if not is_token_id(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_new_tokens], got {_given(self.min_tokens)}")
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        bounds = (("temperature", 0.0, None), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                  ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                  ("repetition_penalty", 0.0, MAX_REPETITION_PENALTY))  # fmt: skip
        for name, low, high in bounds:
            value = getattr(self, name)
            if not _is_real(value) or value < low or (high is not None and value > high) or value != value:
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise RequestError(f"{name} must be a number {bound}, got {_given(value)}")
            object.__setattr__(self, name, float(value))
        if self.top_p == 0.0:
            raise RequestError("top_p must be > 0 (1.0 turns it off)")
        if self.repetition_penalty == 0.0:
            raise RequestError("repetition_penalty must be > 0 (1.0 turns it off)")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not is_token_id(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 turns it off), got {_given(self.top_k)}")
        if self.seed is not None and (not is_token_id(self.seed) or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63) or None, got {_given(self.seed)}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a string or a list of non-empty strings, got {_given(self.stop)}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_token_id(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {_given(value)}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise RequestError(f"structured must be a qwen_mtp.StructuredOutput or None, got {_given(self.structured)}")
        if self.structured is not None and self.min_tokens:
            raise RequestError(
                "min_tokens cannot be combined with a structured output: the grammar decides where it ends"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty, a logit bias or `min_tokens` changes this request's logits."""
        penalties = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        return penalties or self.min_tokens > 0 or any(bias != 0.0 for _, bias in self.logit_bias)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match (`SamplingParams.structured`): exactly one of
    - `json_schema`: a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts;
    - `json_object`: any JSON object (the OpenAI API's `response_format: {"type": "json_object"}`);
    - `regex`: a regular expression the whole output matches;
    - `choice`: one of these strings, exactly;
    - `grammar`: a Lark grammar (llguidance's dialect: https://github.com/guidance-ai/llguidance), or a GBNF one
      (`root ::= ...`, as llama.cpp and xgrammar write them), which llguidance converts.
    `any_whitespace` (JSON only): whitespace may sit wherever JSON allows it (the default, as vLLM's); False
    writes JSON in one line with ", " and ": " between items, which keeps a weak model from spending its tokens
    on whitespace. `after_thinking`: the output starts inside a think block its chat template opened (Qwen's
    `<think>`): any text up to the first `</think>` and the newlines after it is free, the structure applies to what
    follows (the server sets it for chat prompts that open one, with `server.reasoning_parser`). The engine compiles
    it against its tokenizer at submit, so a grammar it cannot use fails there (`RequestError`) and nothing runs."""

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    any_whitespace: bool = True
    after_thinking: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        for name in ("json_object", "any_whitespace", "after_thinking"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {_given(getattr(self, name))}")
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            named = ", ".join(given) or "none"
            raise RequestError(
                f"a structured output is exactly one of json_schema, json_object, regex, choice, grammar; got {named}"
            )
        if isinstance(self.json_schema, str):
            try:
                object.__setattr__(self, "json_schema", json.loads(self.json_schema))
            except ValueError as err:
                raise RequestError(f"json_schema is not valid JSON: {err}") from None
        if self.json_schema is not None and not isinstance(self.json_schema, dict | bool):
            raise RequestError(f"json_schema must be a JSON schema object, got {_given(self.json_schema)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{name} must be a non-empty string, got {_given(value)}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, list | tuple) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise RequestError(f"choice must be a non-empty list of non-empty strings, got {_given(choice)}")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        for name in ("json_schema", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


def _logit_bias(given: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs, from a dict or pairs; `RequestError` saying what was wrong."""
    if isinstance(given, dict):
        pairs = list(given.items())
    elif isinstance(given, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in given):
        pairs = [tuple(p) for p in given]
    else:
        raise RequestError(f"logit_bias must map token ids to biases, got {_given(given)}")
    for token, bias in pairs:
        if not is_token_id(token) or token < 0:
            raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got {_given(token)}")
        if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            bound = f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            raise RequestError(f"logit_bias of token {token} must be a number in {bound}, got {_given(bias)}")
    if len({token for token, _ in pairs}) != len(pairs):
        raise RequestError("logit_bias names a token twice")
    return tuple(sorted((int(token), float(bias)) for token, bias in pairs))


def as_token_ids(prompt: Any) -> list[int]:
    """A prompt as a list of Python ints: a list or tuple of integers, a 1-D integer numpy array or tensor.
    Raises `RequestError` saying what was given otherwise (a str: encode it first; a float, None or a bool)."""
    if isinstance(prompt, str):
        raise RequestError(f"a prompt must be token ids, got a str {prompt[:40]!r}: encode text first (engine.encode)")
    if isinstance(prompt, torch.Tensor) or _is_numpy_array(prompt):
        kind = "tensor" if isinstance(prompt, torch.Tensor) else "numpy array"
        if kind == "tensor":
            integral = not (prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool)
        else:
            integral = prompt.dtype.kind in "iu"
        if prompt.ndim != 1 or not integral:
            raise RequestError(f"a prompt {kind} must be 1-D integer token ids, got {prompt.ndim}-D {prompt.dtype}")
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, list | tuple):
        raise RequestError(f"a prompt must be a list of token ids, got {_given(prompt)}")
    for i, token in enumerate(prompt):
        if not is_token_id(token):
            raise RequestError(f"token ids must be integers, got {_given(token)} at index {i}")
    return [int(t) for t in prompt]


def is_token_id(value: Any) -> bool:
    """An integer that is not a bool (numpy integers included): what a token id can be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_numpy_array(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _given(value: Any) -> str:
    text = repr(value)
    return f"{text[:40]}{'...' if len(text) > 40 else ''} ({type(value).__name__})"
