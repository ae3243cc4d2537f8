"""The OpenAI-compatible HTTP API over one engine (FastAPI): completions and chat completions (streamed as SSE
or not), models, health, tokenize / detokenize and Prometheus metrics. Every request is admitted or refused
at once (400 / 404 / 429 / 503, an OpenAI error body); tokens come from the one `EngineLoop` thread."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from qwen_mtp import __version__
from qwen_mtp.engine import Engine, SamplingParams
from qwen_mtp.errors import RequestError
from qwen_mtp.recipe import ServerSection
from qwen_mtp.serve import responses as shape
from qwen_mtp.serve.loop import EngineLoop, Event, Finished, QueueFull, ShuttingDown
from qwen_mtp.serve.metrics import ServerMetrics
from qwen_mtp.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    generation_defaults,
    template_tools,
)
from qwen_mtp.serve.reasoning import ReasoningSplitter, opens_thinking
from qwen_mtp.serve.relay import Relay
from qwen_mtp.serve.responses import Choice
from qwen_mtp.serve.text import TextAssembler, output_decoder
from qwen_mtp.serve.tools import ToolCallSplitter

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
# `apply_chat_template` arguments the server itself sets: a request's chat_template_kwargs may not
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt", "tools"})


class ModelNotFound(RequestError):
    """The request names a model this server does not serve (HTTP 404)."""


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


def create_app(
    engine: Engine, settings: ServerSection, log: Callable[[str], None] = print, relay: Relay | None = None
) -> FastAPI:
    """The app; its lifespan starts the engine loop and, at shutdown, cancels what still runs. Under tensor
    parallelism (rank 0 only) `relay` tells the other ranks what the loop applies (relay.py)."""
    metrics = ServerMetrics()
    loop = EngineLoop(engine, metrics, settings.max_queue, settings.request_timeout_s, log, relay)
    metrics.watch(lambda: loop.stats, lambda: loop.in_flight)
    api = _Api(engine, loop, settings)
    if api.defaults:
        log(f"sampling defaults from the checkpoint's generation_config.json: {api.defaults}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="qwen-mtp", lifespan=lifespan)
    app.state.engine_loop = loop
    _add_error_handlers(app)
    if settings.api_key is not None:
        _require_api_key(app, settings.api_key)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat_completions(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": api.started,
            "owned_by": "qwen-mtp",
            "max_model_len": engine.config.max_position_embeddings,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if loop.closed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        api.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of prompt or messages")
        if body.messages is not None:
            tools = template_tools(body.tools)
            text = api.chat_text(body.messages, body.add_generation_prompt, body.chat_template_kwargs, tools)
            tokens = engine.encode(text)
        else:
            tokens = engine.encode(body.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.config.max_position_embeddings}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        api.check_model(body.model)
        if engine.tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer: there is no text for token ids")
        vocab = engine.config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:10]}")
        return {"prompt": engine.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = err.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return _error(400, f"the body is not valid JSON: {problems[0].get('msg')}", "invalid_request_error")
        fields = [".".join(str(part) for part in p.get("loc", ()) if part != "body") for p in problems]
        message = "; ".join(f"{where or 'body'}: {p.get('msg')}" for where, p in zip(fields, problems, strict=True))
        return _error(400, message, "invalid_request_error", fields[0] if fields else None)

    @app.exception_handler(ModelNotFound)
    async def model_not_found(request: Request, err: ModelNotFound) -> JSONResponse:
        return _error(404, str(err), "not_found_error", "model")

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, err: RequestError) -> JSONResponse:
        return _error(400, str(err), "invalid_request_error")

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, err: QueueFull) -> JSONResponse:
        return _error(429, str(err), "rate_limit_error")

    @app.exception_handler(ShuttingDown)
    async def shutting_down(request: Request, err: ShuttingDown) -> JSONResponse:
        return _error(503, str(err), "service_unavailable")


class _Job:
    """One HTTP request's engine requests: their events arrive on this event loop's queue."""

    def __init__(self, loop: EngineLoop, requests: list[tuple[list[int], SamplingParams]]):
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        aio = asyncio.get_running_loop()
        self.ids = loop.submit(requests, lambda event: aio.call_soon_threadsafe(self.events.put_nowait, event))
        self.open = set(self.ids)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while self.open:
            event = await self.events.get()
            if isinstance(event, Finished):
                self.open.discard(event.request_id)
            yield event

    async def watched(self, request: Request) -> AsyncIterator[Event]:
        """The events, raising `ClientGone` once the client disconnects (non-streaming requests: checked every
        `DISCONNECT_POLL_S`, whether or not tokens arrive meanwhile)."""
        checked = time.monotonic()
        while self.open:
            try:
                event = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    raise ClientGone
                checked = time.monotonic()
            if event is None:
                continue
            if isinstance(event, Finished):
                self.open.discard(event.request_id)
            yield event

    def cancel_open(self) -> None:
        for request_id in self.open:
            self.loop.cancel(request_id)


class _Api:
    def __init__(self, engine: Engine, loop: EngineLoop, settings: ServerSection):
        self.engine, self.loop, self.settings = engine, loop, settings
        # what a request's left-out sampling fields take (`server.generation_defaults`)
        self.defaults = generation_defaults(engine.checkpoint) if settings.generation_defaults else {}
        self.output_text = output_decoder(engine.tokenizer)
        self.started = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise ModelNotFound(f"model {model!r} is not served here; this server serves {self.settings.model_name!r}")

    def decode(self, token_ids: list[int]) -> str | None:
        """One token's or the prompt's text, special tokens included (logprob entries, echo)."""
        return self.engine.decode(token_ids)

    def chat_text(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """`messages` through the checkpoint's chat template, with `template_kwargs` (the request's
        `chat_template_kwargs`) as more template variables and the request's `tools`."""
        template_kwargs = template_kwargs or {}
        reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise RequestError(f"chat_template_kwargs may not set {reserved}: the server sets them")
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise RequestError(
                "this checkpoint has no chat template (tokenizer_config.json has no chat_template): "
                "use /v1/completions with a prompt you format yourself"
            )
        try:
            text = tokenizer.apply_chat_template(
                [m.as_template_input() for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                **template_kwargs,
            )
        except Exception as err:  # jinja2 errors, and templates that raise on a message order they refuse
            raise RequestError(f"the chat template refused these messages: {type(err).__name__}: {err}") from None
        return text

    def _choices(
        self,
        body,
        prompts: list[list[int]],
        echoes: list[str],
        max_tokens: int,
        logprobs,
        prompt_logprobs,
        after_thinking: bool = False,
    ) -> tuple[list[Choice], list[tuple[list[int], SamplingParams]]]:
        choices, requests = [], []
        for p, (prompt, echo) in enumerate(zip(prompts, echoes, strict=True)):
            for i in range(body.n):
                params = body.sampling_params(max_tokens, logprobs, prompt_logprobs, self.defaults, after_thinking)
                if body.seed is not None and i > 0:  # n answers to one seeded prompt: seeds seed, seed + 1, ...
                    params = _with_seed(params, (body.seed + i) % 2**63)
                assembler = TextAssembler(self.output_text, params.stop)
                choices.append(Choice(p * body.n + i, prompt, assembler, echo, max_tokens == 0))
                requests.append((prompt, params))
        return choices, requests

    # ---- completions -----------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        raw = body.prompts()
        prompts = [self.engine.encode(p) for p in raw]
        max_tokens = self.settings.default_max_tokens if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise RequestError("max_tokens 0 needs echo: true (it returns the prompt and its log-probabilities)")
        if body.stream and body.echo and body.logprobs is not None:
            raise RequestError("echo with logprobs is not available when streaming: use stream: false")
        echoes = [
            (p if isinstance(p, str) else self.decode(ids) or "") if body.echo else ""
            for p, ids in zip(raw, prompts, strict=True)
        ]
        prompt_logprobs = body.logprobs if body.echo else None
        choices, requests = self._choices(body, prompts, echoes, max_tokens, body.logprobs, prompt_logprobs)
        job = _Job(self.loop, requests)
        by_id = dict(zip(job.ids, choices, strict=True))
        response_id = shape.new_id("cmpl")
        want_logprobs = body.logprobs is not None
        if body.stream:
            return self._stream(
                job,
                by_id,
                prompts,
                body.include_usage,
                "text_completion",
                response_id,
                self._completion_chunks(by_id, want_logprobs),
            )
        failed = await self._collect(job, by_id, request)
        if failed is not None:
            return failed
        rows = [shape.completion_choice(c, self.decode, want_logprobs) for c in choices]
        return JSONResponse(
            shape.envelope(
                "text_completion", response_id, self.settings.model_name, rows, usage=shape.usage(choices, prompts)
            )
        )

    def _completion_chunks(self, by_id: dict[int, Choice], want_logprobs: bool):
        def first(choice: Choice) -> dict[str, Any] | None:
            return shape.completion_chunk_choice(choice, choice.echo, None, self.decode, None) if choice.echo else None

        def chunk(choice: Choice, text: str, logprobs, finish: str | None) -> dict[str, Any] | None:
            if choice.drop_output and finish is None:
                return None
            logprobs = logprobs if want_logprobs and not choice.drop_output else None
            return shape.completion_chunk_choice(choice, text, logprobs, self.decode, finish)

        return first, chunk

    # ---- chat completions ------------------------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        logprobs = body.logprobs_count
        parse_tools = body.parses_tool_calls
        if parse_tools and self.settings.tool_call_parser is None:
            raise RequestError(
                "tools need a tool call parser: start the server with server.tool_call_parser=qwen3_coder"
            )
        tools = template_tools(body.tools)
        prompt_text = self.chat_text(body.messages, template_kwargs=body.chat_template_kwargs, tools=tools)
        prompt = self.engine.encode(prompt_text)
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        else:
            max_tokens = self.settings.default_max_tokens if body.max_tokens is None else body.max_tokens
        if max_tokens == 0:
            raise RequestError("max_tokens must be >= 1 for a chat completion")
        # with the reasoning parser, a structured answer (a forced tool call too) is constrained after its thinking
        thinking = self.settings.reasoning_parser is not None and opens_thinking(prompt_text)
        choices, requests = self._choices(body, [prompt], [""], max_tokens, logprobs, None, thinking)
        if self.settings.reasoning_parser is not None:
            for choice in choices:
                choice.reasoning = ReasoningSplitter(thinking)
        if parse_tools:
            for choice in choices:
                choice.tools = ToolCallSplitter(tools)
        job = _Job(self.loop, requests)
        by_id = dict(zip(job.ids, choices, strict=True))
        response_id = shape.new_id("chatcmpl")
        if body.stream:
            return self._stream(
                job,
                by_id,
                [prompt],
                body.include_usage,
                "chat.completion.chunk",
                response_id,
                self._chat_chunks(logprobs is not None),
            )
        failed = await self._collect(job, by_id, request)
        if failed is not None:
            return failed
        rows = [shape.chat_choice(c, self.decode, logprobs is not None) for c in choices]
        return JSONResponse(
            shape.envelope(
                "chat.completion", response_id, self.settings.model_name, rows, usage=shape.usage(choices, [prompt])
            )
        )

    def _chat_chunks(self, want_logprobs: bool):
        def first(choice: Choice) -> dict[str, Any]:
            return shape.chat_chunk_choice(choice, {"role": "assistant", "content": ""}, None, self.decode, None)

        def chunk(choice: Choice, text: str, logprobs, finish: str | None) -> dict[str, Any] | None:
            logprobs = logprobs if want_logprobs else None
            delta = shape.chat_delta(choice, text, final=finish is not None)
            if finish == "stop" and choice.tools is not None and choice.tools.calls:
                finish = "tool_calls"
            return shape.chat_chunk_choice(choice, delta, logprobs, self.decode, finish)

        return first, chunk

    # ---- both ------------------------------------------------------------------------------------------------
    async def _collect(self, job: _Job, by_id: dict[int, Choice], request: Request) -> Response | None:
        """Run the job to its end; a client that disconnects cancels what still runs. Returns the response
        instead of the answer when generation failed (500) or the client is gone."""
        try:
            async for event in job.watched(request):
                choice = by_id[event.request_id]
                if isinstance(event, Finished):
                    choice.end(event.finish_reason, event.result.prompt_logprobs)
                    if event.finish_reason == "error":
                        return JSONResponse(_failure_body(event), status_code=500)
                else:
                    choice.add(event.token_ids, event.logprobs)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the connection is closed
        finally:
            job.cancel_open()
        return None

    def _stream(self, job, by_id, prompts, include_usage: bool, kind: str, response_id: str, chunks) -> Response:
        first, chunk = chunks
        model = self.settings.model_name
        extra = {"usage": None} if include_usage else {}

        def sse(rows: list[dict[str, Any]], **more: Any) -> str:
            return f"data: {json.dumps(shape.envelope(kind, response_id, model, rows, **{**extra, **more}))}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                opening = [row for row in (first(c) for c in by_id.values()) if row is not None]
                if opening:
                    yield sse(opening)
                async for event in job:
                    choice = by_id[event.request_id]
                    if isinstance(event, Finished):
                        text = choice.end(event.finish_reason, event.result.prompt_logprobs)
                        if event.finish_reason == "error":
                            yield f"data: {json.dumps(_failure_body(event))}\n\n"
                        row = chunk(choice, text, None, choice.finish_reason)
                    else:
                        row = chunk(choice, choice.add(event.token_ids, event.logprobs), event.logprobs, None)
                    if row is not None:
                        yield sse([row])
                if include_usage:
                    yield sse([], usage=shape.usage(list(by_id.values()), prompts))
                yield "data: [DONE]\n\n"
            finally:  # the client went away (the task is cancelled) or the stream ended
                job.cancel_open()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _require_api_key(app: FastAPI, key: str) -> None:
    """Every /v1 request must carry `Authorization: Bearer <key>` (`server.api_key`); the others (health, metrics,
    version, tokenize) stay open, as vLLM's `--api-key` leaves them."""
    expected = f"Bearer {key}"

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        given = request.headers.get("authorization", "")
        if request.url.path.startswith("/v1") and not hmac.compare_digest(given.encode(), expected.encode()):
            body = {"message": "invalid or missing API key", "type": "authentication_error", "param": None, "code": 401}
            return JSONResponse({"error": body}, status_code=401)
        return await call_next(request)


def _failure_body(event: Finished) -> dict[str, Any]:
    err = event.result.error
    message = f"generation failed: {type(err).__name__}: {err}" if err is not None else "generation failed"
    return {"error": {"message": message, "type": "server_error", "param": None, "code": 500}}


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)
