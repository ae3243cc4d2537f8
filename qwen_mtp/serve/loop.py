"""The one thread that drives the engine for the server: admitted requests enter the engine here, it steps, and
tokens go out to each request's sink; cancellations (a client gone, a timeout, shutdown) are applied between steps.

Only this thread submits, steps, cancels and reads results, so a request is never finished twice, and everything
that changes the engine happens at a point of this loop that can be told to other ranks: under tensor parallelism
(`relay`) each pass first sends what it applied to the other ranks' engines (relay.py). The HTTP side calls
`submit` (admission: the queue bound and the engine's checks, answered at once; the request gets this loop's id)
and `cancel` from any thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qwen_mtp.engine import Engine, Result, SamplingParams
from qwen_mtp.engine.update import TokenLogprob
from qwen_mtp.errors import QwenMTPError, RequestError
from qwen_mtp.serve.metrics import ServerMetrics
from qwen_mtp.serve.relay import Relay, Tick


class QueueFull(QwenMTPError):
    """More requests than `cache.max_batch + server.max_queue` would be in flight (HTTP 429)."""


class ShuttingDown(QwenMTPError):
    """The server stopped admitting requests (HTTP 503)."""


@dataclass
class Tokens:
    """New tokens of one request (with their log-probabilities when it asked for them)."""

    request_id: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass
class Finished:
    """A request ended: its whole result, and the finish reason the client sees ("timeout" included)."""

    request_id: int
    result: Result
    finish_reason: str


Event = Tokens | Finished
Sink = Callable[[Event], None]


@dataclass
class _Live:
    sink: Sink
    arrived: float
    deadline: float | None
    engine_id: int | None = None  # set once the loop thread has submitted it
    first_token: float | None = None
    tokens: int = 0


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        max_queue: int,
        request_timeout_s: float | None,
        log: Callable[[str], None] = print,
        relay: Relay | None = None,
    ):
        self.engine, self.metrics, self.log, self.relay = engine, metrics, log, relay
        self.capacity = engine.scheduler.max_batch + max_queue  # requests in flight at most
        self.request_timeout_s = request_timeout_s
        self.stats: dict[str, Any] = engine.stats()  # refreshed by the loop after every step (read by /metrics)
        self.failed: BaseException | None = None  # what ended the loop, if anything did (then the server stops)
        self.on_failure: Callable[[], None] = lambda: None  # called on the loop's thread once `failed` is set
        self._ids = itertools.count()
        self._live: dict[int, _Live] = {}  # loop id -> the request
        self._arrived: list[tuple[int, list[int], SamplingParams]] = []  # admitted, not yet submitted to the engine
        self._admit = threading.Lock()  # admission, the live map and the arrivals
        self._by_engine_id: dict[int, int] = {}  # engine id -> loop id (the loop's thread only)
        self._cancels: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closed = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="qwen-mtp-engine-loop", daemon=True)

    # ---- any thread ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[tuple[list[int], SamplingParams]], sink: Sink) -> list[int]:
        """Admit all of `requests` or none: `RequestError` if one can never run, `QueueFull` past the bound,
        `ShuttingDown` once `close` ran. Returns their ids (this loop's); their events go to `sink`, called on
        the loop's thread."""
        for prompt, params in requests:
            self.engine.check_request(prompt, params)
        with self._admit:
            if self._closed:
                raise ShuttingDown("the server is shutting down: no new requests")
            if len(self._live) + len(requests) > self.capacity:
                self.metrics.rejected.inc()
                raise QueueFull(
                    f"{len(self._live)} requests in flight, at most {self.capacity} "
                    "(cache.max_batch + server.max_queue): retry later"
                )
            now = time.monotonic()
            deadline = now + self.request_timeout_s if self.request_timeout_s is not None else None
            ids = []
            for prompt, params in requests:
                request_id = next(self._ids)
                self._live[request_id] = _Live(sink, now, deadline)
                self._arrived.append((request_id, prompt, params))
                ids.append(request_id)
                self.metrics.prompt_tokens.inc(len(prompt))
        self._wake.set()
        return ids

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        """End a request if it still runs (its client went away); its pages and state row come back at once."""
        self._cancels.put((request_id, reason))
        self._wake.set()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Stop admitting; requests already in flight keep running."""
        with self._admit:
            self._closed = True

    def stop(self, timeout: float = 30.0) -> None:
        """Close, cancel whatever still runs, and end the thread."""
        self.close()
        with self._admit:
            ids = list(self._live)
        for request_id in ids:
            self.cancel(request_id)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- the loop's thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as err:  # a failed step under TP, a lost rank, or a bug here: nothing would step any more
            self.failed = err
            self.log(
                f"engine loop stopped: {type(err).__name__}: {err} (under tensor parallelism a failed step or a "
                "lost rank ends the server on every rank; at TP=1 only a failed step is survivable)"
            )
            self.close()
            for request_id in list(self._live):
                self._finish(request_id, "error")
            self.on_failure()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            self._wake.clear()
            submitted = self._enter_arrivals()
            cancelled = self._apply_cancels()
            stop = self._stop and not self._live
            step = not stop and engine.has_unfinished()
            if self.relay is not None:
                self.relay.send(Tick(submitted, cancelled, step, stop))
            if stop:
                break
            if step:
                self._step()
            else:
                self._wake.wait(self._idle_wait())
            self.stats = engine.stats()

    def _enter_arrivals(self) -> tuple[tuple[int, list[int], SamplingParams], ...]:
        """Submit the requests admitted since the last pass, in admission order; returns them as submitted (with
        the seed the engine drew), for the other ranks."""
        with self._admit:
            arrived, self._arrived = self._arrived, []
        submitted = []
        for request_id, prompt, params in arrived:
            try:
                engine_id = self.engine.submit(prompt, params)
            except RequestError as err:  # checked at admission: only a check that changed since then gets here
                self._finish(request_id, "error", Result([], "error", len(prompt), error=err))
                continue
            self._live[request_id].engine_id = engine_id
            self._by_engine_id[engine_id] = request_id
            submitted.append((request_id, prompt, self.engine.requests[engine_id].params))
        return tuple(submitted)

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as err:  # a step that fails as a whole: its requests end, the server goes on
            if self.relay is not None:  # ... except under TP, where the ranks' collectives may have parted
                raise
            self.log(f"engine step failed: {type(err).__name__}: {err}")
            for request_id, live in list(self._live.items()):
                if live.engine_id is not None:
                    self.engine.cancel(live.engine_id)
                self._finish(request_id, "error")
            return
        now = time.monotonic()
        for update in updates:
            request_id = self._by_engine_id.get(update.request_id)
            if request_id is None:
                continue
            if update.new_token_ids:
                self._deliver_tokens(request_id, update.new_token_ids, update.logprobs, now)
            if update.finished:
                self._finish(request_id, None)

    def _idle_wait(self) -> float:
        deadlines = [live.deadline for live in self._live.values() if live.deadline is not None]
        wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
        return wait if self.relay is None else min(wait, self.relay.heartbeat_s)

    def _apply_cancels(self) -> tuple[int, ...]:
        """End the requests cancelled or timed out since the last pass; returns their ids, for the other ranks."""
        now = time.monotonic()
        for request_id, live in list(self._live.items()):
            if live.deadline is not None and now >= live.deadline:
                self._cancels.put((request_id, "timeout"))
        cancelled = []
        while not self._cancels.empty():
            request_id, reason = self._cancels.get()
            live = self._live.get(request_id)
            if live is not None and live.engine_id is not None:
                self.engine.cancel(live.engine_id)  # no step runs now: applied at once
                self._finish(request_id, reason)
                cancelled.append(request_id)
        return tuple(cancelled)

    def _deliver_tokens(self, request_id: int, tokens: list[int], logprobs, now: float) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        if live.first_token is None:
            live.first_token = now
            self.metrics.ttft.observe(now - live.arrived)
        live.tokens += len(tokens)
        self.metrics.count_generated(len(tokens), now)
        live.sink(Tokens(request_id, list(tokens), logprobs))

    def _finish(self, request_id: int, reason: str | None, result: Result | None = None) -> None:
        """Read the result (the engine forgets the request), send it, and record the request's figures."""
        with self._admit:
            live = self._live.pop(request_id, None)
        if live is None:
            return
        if result is None:
            result = self._read_result(live.engine_id)
        finish_reason = reason or result.finish_reason
        now = time.monotonic()
        if live.first_token is not None and live.tokens > 1:
            self.metrics.tpot.observe((now - live.first_token) / (live.tokens - 1))
        self.metrics.finished.labels(finish_reason).inc()
        if result.error is not None:
            self.log(f"request {request_id} failed: {type(result.error).__name__}: {result.error}")
        live.sink(Finished(request_id, result, finish_reason))

    def _read_result(self, engine_id: int | None) -> Result:
        if engine_id is None:  # admitted, never submitted (the loop stopped first)
            return Result([], "error", 0)
        self._by_engine_id.pop(engine_id, None)
        try:
            return self.engine.result(engine_id)
        except RequestError:  # already read: cannot happen while only this thread reads results
            return Result([], "error", 0)
