"""The one thread that steps the engine for the server: requests come in through the engine's inbox, tokens go
out to each request's sink; cancellations (a client gone, a timeout, shutdown) are applied between steps.

Only this thread steps, cancels and reads results, so a request is never finished twice. The HTTP side calls
`submit` (admission: the queue bound and the engine's checks, answered at once) and `cancel` from any thread.
"""

from __future__ import annotations

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
    ):
        self.engine, self.metrics, self.log = engine, metrics, log
        self.capacity = engine.scheduler.max_batch + max_queue  # requests in flight at most
        self.request_timeout_s = request_timeout_s
        self.stats: dict[str, Any] = engine.stats()  # refreshed by the loop after every step (read by /metrics)
        self._live: dict[int, _Live] = {}
        self._admit = threading.Lock()  # admission and the live map
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
        `ShuttingDown` once `close` ran. Their events go to `sink`, called on the loop's thread."""
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
                request_id = self.engine.submit(prompt, params)
                self._live[request_id] = _Live(sink, now, deadline)
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
        engine = self.engine
        while True:
            self._wake.clear()
            self._apply_cancels()
            if self._stop and not self._live:
                break
            if engine.has_unfinished():
                try:
                    updates = engine.step()
                except Exception as err:  # a step that fails as a whole: its requests end, the server goes on
                    self.log(f"engine step failed: {type(err).__name__}: {err}")
                    for request_id in list(self._live):
                        engine.cancel(request_id)
                        self._finish(request_id, "error")
                    updates = []
                now = time.monotonic()
                for update in updates:
                    if update.new_token_ids:
                        self._deliver_tokens(update.request_id, update.new_token_ids, update.logprobs, now)
                    if update.finished:
                        self._finish(update.request_id, None)
            else:
                self._wake.wait(self._idle_wait())
            self.stats = engine.stats()

    def _idle_wait(self) -> float:
        deadlines = [live.deadline for live in self._live.values() if live.deadline is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0

    def _apply_cancels(self) -> None:
        now = time.monotonic()
        for request_id, live in list(self._live.items()):
            if live.deadline is not None and now >= live.deadline:
                self._cancels.put((request_id, "timeout"))
        while not self._cancels.empty():
            request_id, reason = self._cancels.get()
            if request_id in self._live:
                self.engine.cancel(request_id)  # no step runs now: applied at once
                self._finish(request_id, reason)

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

    def _finish(self, request_id: int, reason: str | None) -> None:
        """Read the result (the engine forgets the request), send it, and record the request's figures."""
        with self._admit:
            live = self._live.pop(request_id, None)
        if live is None:
            return
        try:
            result = self.engine.result(request_id)
        except RequestError:  # already read: cannot happen while only this thread reads results
            result = Result([], "error", 0)
        finish_reason = reason or result.finish_reason
        now = time.monotonic()
        if live.first_token is not None and live.tokens > 1:
            self.metrics.tpot.observe((now - live.first_token) / (live.tokens - 1))
        self.metrics.finished.labels(finish_reason).inc()
        if result.error is not None:
            self.log(f"request {request_id} failed: {type(result.error).__name__}: {result.error}")
        live.sink(Finished(request_id, result, finish_reason))
