"""Who runs next. The scheduler decides; it never touches tensors.

- Admission is first-come first-served: the head of the waiting queue is admitted when a batch place, a state
  row and its worst-case KV pages are free; requests behind it wait their turn (admission order is kept).
- Prefill is chunked: a prompt advances `prefill_chunk` tokens per step, and its chunk boundaries are always
  multiples of `prefill_chunk` from the prompt start, whatever else runs, so its numerics never depend on the
  batch.
- Every running request that has finished its prefill decodes one token per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine.request import Request, Status


@dataclass
class PrefillChunk:
    request: Request
    start: int
    length: int


@dataclass
class Schedule:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, pages: PagePool, states: StatePool, max_batch: int, prefill_chunk: int, lookahead: int = 0):
        self.pages = pages
        self.states = states
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.lookahead = lookahead  # extra positions a step may write beyond the sequence (MTP verify)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or cancelled request out of the queues and give back its pages and state row."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.pages.release(request.id)
        self.states.release(request.id)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch and self.states.free_rows > 0:
            head = self.waiting[0]
            if not self.pages.can_reserve(head.max_len + self.lookahead):
                break
            self.waiting.popleft()
            self.pages.reserve(head.id, head.max_len + self.lookahead)
            self.states.allocate(head.id)
            head.status = Status.RUNNING
            self.running.append(head)

    def schedule(self) -> Schedule:
        self._admit()
        plan = Schedule()
        for request in self.running:
            if request.in_prefill:
                start = request.num_computed
                end = min(len(request.prompt), (start // self.prefill_chunk + 1) * self.prefill_chunk)
                plan.prefills.append(PrefillChunk(request, start, end - start))
            else:
                plan.decodes.append(request)
        return plan
