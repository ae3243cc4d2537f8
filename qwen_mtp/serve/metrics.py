"""The server's Prometheus metrics (`GET /metrics`): request latencies and tokens counted by the engine loop,
and the engine's pools, queue and speculation read from its last `stats()` at scrape time."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "qwen_mtp"
THROUGHPUT_WINDOW_S = 10.0  # tokens/s is the rate over this trailing window
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """One registry per server (never the process-global one), so several servers in one process stay apart."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "per request: (last - first token) / (tokens - 1)",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.generated = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens admitted", registry=r)
        self.finished = Counter(
            f"{PREFIX}_requests_finished", "requests ended, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "requests refused with 429 (queue full)", registry=r)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) in the window
        self._recent_lock = threading.Lock()

    def count_generated(self, tokens: int, now: float) -> None:
        self.generated.inc(tokens)
        with self._recent_lock:
            self._recent.append((now, tokens))
            self._trim(now)

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._recent_lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def watch(self, stats: Callable[[], dict[str, Any]], in_flight: Callable[[], int]) -> None:
        """Report the engine's state (its last `stats()`) at every scrape."""
        self.registry.register(_EngineCollector(stats, in_flight, self.tokens_per_second))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]], in_flight: Callable[[], int], rate: Callable[[], float]):
        self.stats, self.in_flight, self.rate = stats, in_flight, rate

    def collect(self) -> Iterator[Metric]:
        s = self.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield gauge(
            "generation_tokens_per_second",
            f"tokens generated per second over the last {THROUGHPUT_WINDOW_S:g} s",
            self.rate(),
        )
        yield gauge("requests_in_flight", "requests admitted and not yet finished", self.in_flight())
        yield gauge("requests_running", "requests in the running batch", s["running"])
        yield gauge("queue_depth", "requests waiting for a batch place", s["waiting"])
        yield gauge("kv_pages_total", "KV cache pages in the pool", s["total_pages"])
        yield gauge("kv_pages_in_use", "KV cache pages held by requests", s["total_pages"] - s["free_pages"])
        yield gauge("state_rows_total", "recurrent-state rows in the pool", s["total_state_rows"])
        yield gauge(
            "state_rows_in_use", "recurrent-state rows held by requests", s["total_state_rows"] - s["free_state_rows"]
        )
        if "drafted" in s:
            yield CounterMetricFamily(f"{PREFIX}_spec_verify_steps", "MTP verify steps", value=s["verify_steps"])
            yield CounterMetricFamily(f"{PREFIX}_spec_drafted_tokens", "MTP draft tokens verified", value=s["drafted"])
            yield CounterMetricFamily(
                f"{PREFIX}_spec_accepted_tokens", "MTP draft tokens accepted", value=s["accepted"]
            )
            yield gauge(
                "spec_acceptance_length",
                "tokens per verify step (accepted drafts + 1), since start",
                s["acceptance_length"],
            )
            per = GaugeMetricFamily(
                f"{PREFIX}_spec_position_acceptance", "share of drafts accepted at each position", labels=["position"]
            )
            for i, rate in enumerate(s["position_acceptance"]):
                per.add_metric([str(i + 1)], rate)
            yield per
            if s["step_k"] is not None:
                doc = "drafts per request in the latest verify step (mtp.k, or k auto's choice)"
                yield gauge("spec_step_k", doc, s["step_k"])
        if "k_auto_acceptance" in s:
            estimate = GaugeMetricFamily(
                f"{PREFIX}_spec_k_auto_acceptance",
                "k auto's running acceptance estimate at each draft position (given the earlier ones accepted)",
                labels=["position"],
            )
            for i, rate in enumerate(s["k_auto_acceptance"]):
                estimate.add_metric([str(i + 1)], rate)
            yield estimate
