"""Who runs next, which positions each request writes this step, and every page and state row they take.
The scheduler decides and allocates; it never touches tensors.

- Admission is first-come first-served: the head of the waiting queue is admitted when a batch place, a state
  row and its worst-case KV pages (`positions_reserved`) are free; requests behind it wait their turn
  (admission order is kept). Admission takes the request's state row and reserves its pages.
- Prefill is chunked: a prompt advances `prefill_chunk` tokens per step, and its chunk boundaries are always
  multiples of `prefill_chunk` from the prompt start, whatever else runs, so its numerics never depend on the
  batch.
- Every running request past its prefill decodes one token (plain) or verifies K drafts (speculative) per step.
- Before the step runs, the scheduler grows each request's pages to cover every position the step may write
  (`Schedule.reach`), from the reservation: the runner never allocates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine.request import Request, Status


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int  # first prompt position of the chunk
    length: int
    drafts: bool  # the prompt's last chunk of a speculative request: the MTP head drafts for the first verify

    @property
    def last(self) -> bool:
        return self.start + self.length == len(self.request.prompt)


@dataclass
class Schedule:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # plain: token n at position n
    verifies: list[Request] = field(default_factory=list)  # speculative: verify, accept, commit, draft
    # request id -> the step may write positions [0, reach) (target and MTP KV); the pages are grown for them
    reach: dict[int, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies


class Scheduler:
    def __init__(self, pages: PagePool, states: StatePool, max_batch: int, prefill_chunk: int, k: int = 0):
        self.pages = pages
        self.states = states
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.k = k  # MTP draft length (0 without MTP)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def positions_reserved(self, max_len: int, speculative: bool) -> int:
        """The most positions any step of a request of `max_len` tokens (prompt + max_new_tokens) can write
        into. Plain: max_len. An MTP verify at n (n <= max_len - 2 while the request runs) writes n..n+K, and
        its draft chain, having accepted up to K drafts, the MTP KV up to n + 2K - 1."""
        return max_len + (2 * self.k if speculative else 0)

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
            reserve = self.positions_reserved(head.max_len, head.spec is not None)
            if not self.pages.can_reserve(reserve):
                break
            self.waiting.popleft()
            self.pages.reserve(head.id, reserve)
            self.states.allocate(head.id)
            head.status = Status.RUNNING
            self.running.append(head)

    def schedule(self) -> Schedule:
        self._admit()
        plan = Schedule()
        for request in self.running:
            n = request.num_computed
            if request.in_prefill:
                end = min(len(request.prompt), (n // self.prefill_chunk + 1) * self.prefill_chunk)
                drafts = request.spec is not None and end == len(request.prompt) and request.max_new_tokens > 1
                plan.prefills.append(PrefillChunk(request, n, end - n, drafts))
                # the chain after the last chunk writes the MTP KV of positions end..end+K-2
                plan.reach[request.id] = end + (self.k - 1 if drafts else 0)
            elif request.spec is None:
                plan.decodes.append(request)
                plan.reach[request.id] = n + 1
            else:
                plan.verifies.append(request)
                plan.reach[request.id] = n + 2 * self.k
            self.pages.grow(request.id, plan.reach[request.id])
        return plan
