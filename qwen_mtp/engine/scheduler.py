"""Who runs next, which positions each request writes this step, and every page and state row they take.
The scheduler decides and allocates; it never touches tensors.

- Admission is first-come first-served: the head of the waiting queue is admitted when a batch place, a state
  row and its worst-case KV pages (`positions_reserved`) are free; requests behind it wait their turn
  (admission order is kept). Admission takes the request's state row and reserves its pages.
- Prefill is chunked: a prompt advances `prefill_chunk` tokens per step, and its chunk boundaries are always
  multiples of `prefill_chunk` from the prompt start, whatever else runs, so its numerics never depend on the
  batch.
- Every running request past its prefill decodes one token (plain) or verifies K drafts (speculative) per step.
- Mixed steps (`max_step_tokens` given): the decode and verify rows (1 and K+1 tokens a request) come first, so a
  running request never waits behind a prompt; then prefill chunks in admission order while they fit in what is
  left of the budget (the first that does not fit waits for the next step, and so do those behind it). Without a
  budget every request in prefill runs its next chunk.
- Before the step runs, the scheduler grows each request's pages to cover every position the step may write
  (`Schedule.reach`), from the reservation: the runner never allocates.
- Lookahead (`schedule_ahead`): the next decode or verify step of the requests of the step in flight, launched
  before that step's tokens are read (a decode one position past what a request has computed; a verify past what
  the one in flight accepts, known on the device only). Only when those requests are all that runs, none can end
  by length before it, and nothing waits. The reservation covers it: a verify ahead reaches n + 3K + 1 <=
  max_len + 2K.
- Prefix caching (`prefix` given): admission looks up the longest cached prefix of the prompt that ends on a
  state snapshot; the request's page table starts with its shared pages, its reservation counts only the pages
  it will own, its prefill starts after the prefix (`num_computed`, set at admission) and the engine restores
  the snapshot into its row first (`Schedule.restores`). Cached pages are evicted (LRU, leaves first) when
  admission needs them. Each full chunk a request computes gets a snapshot slot when its chunk has none cached
  yet (`PrefillChunk.snapshot`). Cache fills (internal requests that prefill a finished request's output
  chunks, `Request.fill_end`) wait in their own queue and are admitted only when no user request waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qwen_mtp.cache.kv import PagePool
from qwen_mtp.cache.prefix import PrefixCache, PrefixHit
from qwen_mtp.cache.state import StatePool
from qwen_mtp.engine.request import Request, Status


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int  # first prompt position of the chunk
    length: int
    drafts: bool  # the prompt's last chunk of a speculative request: the MTP head drafts for the first verify
    snapshot: int | None = None  # prefix caching: the slot that takes the GDN state after this full chunk

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
    # prefix hits admitted this step: (request, snapshot slot) to restore into its state row before its prefill
    restores: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies


class Scheduler:
    def __init__(
        self,
        pages: PagePool,
        states: StatePool,
        max_batch: int,
        prefill_chunk: int,
        k: int = 0,
        prefix: PrefixCache | None = None,
        max_step_tokens: int | None = None,
    ):
        self.pages = pages
        self.states = states
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.k = k  # MTP draft length (0 without MTP)
        self.prefix = prefix
        self.max_step_tokens = max_step_tokens  # mixed steps: decode/verify rows + prefill tokens; None: no cap
        self.waiting: deque[Request] = deque()
        self.fills: deque[Request] = deque()  # prefix-cache fills, admitted when no user request waits
        self.running: list[Request] = []

    def positions_reserved(self, max_len: int, speculative: bool) -> int:
        """The most positions any step of a request of `max_len` tokens (prompt + max_new_tokens) can write
        into. Plain: max_len. An MTP verify at n (n <= max_len - 2 while the request runs) writes n..n+K, and
        its draft chain, having accepted up to K drafts, the MTP KV up to n + 2K - 1."""
        return max_len + (2 * self.k if speculative else 0)

    def add(self, request: Request) -> None:
        (self.waiting if request.fill_end is None else self.fills).append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or cancelled request out of the queues and give back its pages, state row and the
        cached chunks it held."""
        for queue in (self.waiting, self.fills, self.running):
            if request in queue:
                queue.remove(request)
        self.pages.release(request.id)
        self.states.release(request.id)
        if self.prefix is not None:
            self.prefix.release(request.id)

    def _admit(self, plan: Schedule) -> None:
        while self.waiting and self._admit_one(self.waiting[0], plan):
            self.waiting.popleft()
        while not self.waiting and self.fills and self._admit_one(self.fills[0], plan):
            self.fills.popleft()

    def _admit_one(self, request: Request, plan: Schedule) -> bool:
        """Admit `request` if a batch place, a state row and the pages it must own are free (evicting cached
        prefixes for pages if needed)."""
        if len(self.running) >= self.max_batch or self.states.free_rows == 0:
            return False
        if request.fill_end is not None:
            positions = request.fill_end
        else:
            positions = self.positions_reserved(request.max_len, request.spec is not None)
        hit = PrefixHit()
        if self.prefix is not None:
            if request.params.prompt_logprobs is None:  # prompt logprobs need every prompt position's logits
                hit = self.prefix.lookup(request.prompt, request.spec is not None)
            self.prefix.hold(request.id, hit)  # before making room, so the hit is not evicted for itself
            if not self.prefix.make_room(self.pages.pages_to_reserve(positions, len(hit.pages))):
                self.prefix.release(request.id)
                return False
            if request.fill_end is None:
                self.prefix.record(hit)
        elif not self.pages.can_reserve(positions):
            return False
        self.pages.reserve(request.id, positions, hit.pages)
        self.states.allocate(request.id)
        request.status = Status.RUNNING
        request.num_computed = request.cached_tokens = hit.length  # prefill starts after the restored prefix
        if hit.nodes:
            plan.restores.append((request, hit.snapshot))
        self.running.append(request)
        return True

    def _snapshot_slot(self, request: Request, start: int, end: int) -> int | None:
        """A snapshot slot for the state after the full chunk [start, end), unless one is cached already."""
        if self.prefix is None or end - start != self.prefill_chunk:
            return None
        if not self.prefix.wants_snapshot(request.id, tuple(request.prompt[start:end])):
            return None
        return self.prefix.snapshot_slot()

    def schedule_ahead(self, requests: list[Request]) -> bool:
        """Whether the next step of `requests`, whose current step is still in flight (its tokens not yet
        applied), may be launched now: a plain decode at position num_computed + 1, or a verify from num_computed
        + 1 + (what the one in flight accepts, up to K); if so, their pages are grown for it. Only when they are
        every running request, all plain or all speculative, none in prefill or a cache fill, each sure to run
        that step (the one in flight cannot end it by length), and no request or cache fill waits."""
        if self.waiting or self.fills or len(requests) != len(self.running):
            return False
        running = {r.id for r in self.running}
        speculative = requests[0].spec is not None
        extra = self.k if speculative else 0  # a verify in flight emits up to K + 1 tokens
        for request in requests:
            same = (request.spec is not None) == speculative and request.fill_end is None and not request.in_prefill
            if (
                request.done
                or request.id not in running
                or not same
                or request.num_computed + extra + 3 > request.max_len
            ):
                return False
        # a verify reaches at most n + K + 1 .. n + 2K + 1, its chain's MTP KV n + 3K; a decode n + 1
        reach = 3 * self.k + 1 if speculative else 2
        for request in requests:
            self.pages.grow(request.id, request.num_computed + reach)
        return True

    def schedule(self) -> Schedule:
        plan = Schedule()
        self._admit(plan)
        prefilling = []
        for request in self.running:
            n = request.num_computed
            if request.fill_end is not None and n >= request.fill_end:
                continue  # a cache fill that is done: the engine ends it after this step
            if request.in_prefill:
                prefilling.append(request)
                continue
            if request.spec is None:
                plan.decodes.append(request)
                plan.reach[request.id] = n + 1
            else:
                plan.verifies.append(request)
                plan.reach[request.id] = n + 2 * self.k
            self.pages.grow(request.id, plan.reach[request.id])
        budget = self.max_step_tokens
        if budget is not None:
            budget -= len(plan.decodes) + len(plan.verifies) * (self.k + 1)
        for request in prefilling:  # in admission order: the first that does not fit ends the step's prefills
            n = request.num_computed
            end = min(len(request.prompt), (n // self.prefill_chunk + 1) * self.prefill_chunk)
            if budget is not None:
                if end - n > budget:
                    break
                budget -= end - n
            drafts = request.spec is not None and end == len(request.prompt) and request.max_new_tokens > 1
            plan.prefills.append(PrefillChunk(request, n, end - n, drafts, self._snapshot_slot(request, n, end)))
            # the chain after the last chunk writes the MTP KV of positions end..end+K-2
            plan.reach[request.id] = end + (self.k - 1 if drafts else 0)
            self.pages.grow(request.id, plan.reach[request.id])
        return plan
