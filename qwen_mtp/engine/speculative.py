"""MTP speculation: draft K tokens with the model's MTP head, verify them in one packed target forward,
accept the longest matching prefix plus a bonus token, and commit the GDN state by index, all on the device.

Per running request, between steps: `num_computed = n` target positions are cached, the last emitted token
`t_n` is not yet consumed, and `drafts = [d1..dK]` guess the tokens at n+1..n+K.

    verify   target over [t_n, d1..dK] at positions n..n+K   -> hidden H_0..H_K, chosen c_0..c_K
    accept   j = longest prefix with d_i == c_{i-1} (`sampling.accept`); the request emits c_0..c_j
    commit   SSM slot j and conv offset j (written by the verify itself); attention KV rolls back by length
    catch-up MTP over positions n..n+K with (c_i, H_i): rewrites the MTP KV of the accepted positions from the
             target's hidden states (draft-chain entries there were provisional); its output at index j drafts
             d1 of the next step
    chain    d_k (k >= 2) from the MTP's own post-norm output and d_{k-1}, one position further each time

`j` stays on the device from the verify to the commit and the draft: the host learns it, with the chosen
tokens and the next drafts, in the step's one read-back. The emitted tokens are always the target's choice, so
the output equals plain decoding whenever the verify computes each position as a 1-token decode does
(batch-invariant ops) and chooses with the same noise there (`sampling.py`: keyed by seed and position, greedy
or sampled). The head's drafts use that noise too (coupled drafts), or greedy argmax (`mtp.coupled_drafts`
false): either way only acceptance changes, never the tokens.

K may change from step to step (`mtp.k: auto`, `k_policy.py`): a step verifies K drafts per request, the first
K of those it has, padded with filler tokens when it has fewer (after a step with a smaller K); a filler is
rarely accepted, and when it is, it equals the target's choice, so the tokens stay the target's. A K = 0 step
is a plain decode step: it runs no MTP work, and keeps the target's hidden state of its position instead; the
first step with K > 0 (or `MAX_BEHIND` such positions) runs the MTP head over the positions its requests missed,
as over prompt chunks packed in one forward, and drafts from there in one chain (`_catch_up`), so the MTP KV never
misses a position and later drafts stay as good, while a batch that decodes plainly pays nothing for staying
ready. The state pool and the page reservations are sized for `max_k`.

A request with a structured output verifies the tokens its grammar forces next (`grammar.forced_drafts`: a JSON
key, a tool call's fixed text) in place of the head's first drafts: the target, masked to those tokens, chooses them
unless the grammar allows another spelling there, so they are accepted where the head (which never sees the mask)
would guess otherwise. Only acceptance changes.

Oracle drafts (`mtp.draft: oracle`, for benchmarks and tests) replace the head's proposal for output index i
with the plain-decoding token there when a seeded draw for (seed, request, i) falls under `oracle_accept`, so
they never depend on the batch. Since j is not known on the host, each step passes the oracle tokens for every
possible j (a window of 2K output indices) and the device picks by j.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from qwen_mtp.cache.kv import pages_for
from qwen_mtp.engine import grammar, sampling
from qwen_mtp.engine.k_policy import KPolicy, StepTimes
from qwen_mtp.engine.paged_cache import StepBatch, StepKind
from qwen_mtp.engine.request import Request, SpecStats
from qwen_mtp.engine.runner import Runner
from qwen_mtp.parallel.collectives import all_gather

FILLER = 0  # the draft token of a position a request has no draft for (after a step with a smaller K)
MAX_BEHIND = 256  # K = 0 positions a request's MTP KV may lag before they are caught up anyway (memory: H each)


@dataclass
class Verified:
    """A verify step's device results, for the draft step and the read-back."""

    batch: StepBatch
    hidden: torch.Tensor  # target hidden [B, K+1, H]
    chosen: torch.Tensor  # chosen tokens [B, K+1]
    accepted: torch.Tensor  # drafts accepted per request [B] (j)
    logprobs: sampling.Logprobs | None  # of the chosen tokens, when a request asks
    drafted: tuple[int, ...]  # real drafts each request's row verifies (the rest of its K are fillers)
    shift: torch.Tensor | None = None  # a lookahead verify: the accepted counts [B] of the verify before it

    @property
    def k(self) -> int:
        """Drafts verified per request (0..max_k)."""
        return self.chosen.shape[1] - 1


@dataclass
class Ahead:
    """What a lookahead verify starts from: the verify in flight and the drafts its chain proposed [B, K]."""

    verified: Verified
    drafts: torch.Tensor


class Speculator:
    """`k`: drafts per step, or "auto" (a `KPolicy` chooses 0..max_k per step over `buckets`, the batch sizes
    the decode path runs at; their step times are measured on first use or by `calibrate`)."""

    def __init__(
        self,
        runner: Runner,
        k: int | str,
        draft: str = "head",
        oracle_accept: float = 1.0,
        seed: int = 0,
        max_k: int = 4,
        buckets: Sequence[int] = (1,),
    ):
        self.runner = runner
        self.max_k = max_k if k == "auto" else k  # the most drafts a step verifies (pools are sized for it)
        self.policy: KPolicy | None = None
        if k == "auto":
            self.policy = KPolicy(self.max_k, buckets, self.agreed_times)
        self.draft_mode, self.oracle_accept, self.seed = draft, oracle_accept, seed
        self.totals = SpecStats(self.max_k)  # every verify step of every request, for Engine.stats()
        self.last_k: int | None = None  # the K of the latest verify step (Engine.stats(); None before the first)
        self._oracles: dict[int, tuple[list[int], list[bool]]] = {}  # request -> (tokens, use) per output index
        # request -> (first position, the target's hidden [H] at each position since): what K = 0 steps left for
        # the MTP head to catch up with
        self._behind: dict[int, tuple[int, list[torch.Tensor]]] = {}

    @property
    def oracle(self) -> bool:
        return self.draft_mode == "oracle"

    def start(self, request: Request, oracle: list[int] | None = None) -> None:
        """Decode `request` speculatively; in oracle mode `oracle` is its plain-decoding continuation."""
        request.spec = SpecStats(self.max_k)
        if self.oracle:
            draw = random.Random(f"{self.seed}:{request.id}")
            tokens = list(oracle or [])
            self._oracles[request.id] = (tokens, [draw.random() < self.oracle_accept for _ in tokens])

    def forget(self, request: Request) -> None:
        self._oracles.pop(request.id, None)
        self._behind.pop(request.id, None)

    # ---- prefill -------------------------------------------------------------------------------------------
    def prefill_chunk(
        self, request: Request, start: int, hidden: torch.Tensor, first: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Fill the MTP KV for a prompt chunk's positions from the target's hidden states [1, T, H]. With the
        prompt's first output token (`first` [1], on the device) also draft for the first verify: drafts
        [1, max_k] (a later step verifies the first K of them)."""
        length = hidden.shape[1]
        end = start + length
        following = self.runner.tensor([request.prompt[start + 1 : end + 1]])  # token i+1 at position i
        if first is not None:
            following = torch.cat([following, first[:, None]], dim=1)
        batch = self.runner.batch(StepKind.PREFILL, [request], following, [start])
        mtp_hidden = self.runner.prefill_mtp(batch, hidden)
        if first is None:
            return None
        batch = replace(batch, sampling=self.runner.chain_sampling([request]))  # drafts as the verify chooses
        accepted = torch.zeros(1, dtype=torch.long, device=hidden.device)
        override, use = self._overrides([request], [1], accepted, self.max_k)  # d1 is output index 1
        return self.runner.chain(batch, mtp_hidden[:, -1], self.runner.tensor([end]), override, use)

    # ---- decode --------------------------------------------------------------------------------------------
    def step_k(self, count: int) -> int:
        """The drafts a step of `count` requests verifies: `mtp.k`, or the policy's choice."""
        return self.max_k if self.policy is None else self.policy.choose(count)

    def verify(self, requests: list[Request], k: int | None = None, after: Ahead | None = None) -> Verified:
        """One packed target forward over [t_n, d1..dK] per request (K = `k`, default max_k), acceptance, and
        the commit of each request's state at its accepted boundary. `after` (a lookahead verify): the verify in
        flight and its drafts, still on the device; this one starts where that one will have accepted up to."""
        k = self.max_k if k is None else k
        self.last_k = k if after is None else after.verified.k
        if self.policy is not None:
            self.policy.stepped(self.last_k, len(requests))
        if after is not None:
            previous = after.verified
            last = previous.chosen.gather(1, previous.accepted[:, None])  # c_j: the last token it emits
            tokens = torch.cat([last, after.drafts], dim=1)
            starts = [r.num_computed + 1 for r in requests]  # + j, on the device
            batch = self.runner.batch(StepKind.DECODE, requests, tokens, starts, shift=previous.accepted)
            return self._verify(batch, (previous.k,) * len(requests), previous.accepted)  # its chain's K drafts
        if k > 0:  # drafts for the requests K = 0 steps left behind
            self._catch_up([r for r in requests if r.id in self._behind], draft=True)
        else:
            self._catch_up([r for r in requests if self._lag(r) >= MAX_BEHIND], False)
        tokens, drafted = [], []
        for r in requests:
            drafts = r.drafts[:k] if r.grammar is None else grammar.forced_drafts(r.grammar, r.drafts, k)
            drafted.append(len(drafts))
            tokens.append([r.tokens[r.num_computed]] + drafts + [FILLER] * (k - len(drafts)))
        batch = self.runner.batch(StepKind.DECODE, requests, tokens, [r.num_computed for r in requests])
        return self._verify(batch, tuple(drafted))

    def _verify(self, batch: StepBatch, drafted: tuple[int, ...], shift: torch.Tensor | None = None) -> Verified:
        hidden, chosen, logprobs = self.runner.decode(batch)  # [B, K+1, H], [B, K+1]
        accepted = sampling.accept(batch.token_ids[:, 1:], chosen)
        self.runner.states.commit(batch.state_rows, accepted)
        self.runner.count_emitted(batch, chosen, accepted)
        return Verified(batch, hidden, chosen, accepted, logprobs, drafted, shift)

    def propose(self, requests: list[Request], verified: Verified) -> torch.Tensor:
        """MTP catch-up over the verified positions, then the draft chain: the next drafts [B, K]. After a K = 0
        step: nothing runs; the target's hidden states wait for `_catch_up` ([B, 0] drafts)."""
        if verified.k == 0:
            hidden = verified.hidden[:, 0].clone()  # a CUDA graph's output buffer: the next replay rewrites it
            for b, request in enumerate(requests):
                self._behind.setdefault(request.id, (request.num_computed, []))[1].append(hidden[b])
            return verified.chosen.new_zeros(len(requests), 0)
        batch = replace(verified.batch, token_ids=verified.chosen)
        # the next step's d1 is output index n + j + 2 - prompt length (a lookahead verify: its n is one past
        # what the host knows, plus the accepted count of the verify before it)
        firsts = [r.num_computed + 2 - len(r.prompt) + (verified.shift is not None) for r in requests]
        offset, span = verified.accepted, 2 * verified.k
        if verified.shift is not None:
            offset, span = offset + verified.shift, 3 * verified.k
        override, use = self._overrides(requests, firsts, offset, verified.k, span)
        return self.runner.draft(batch, verified.hidden, verified.accepted, override, use)

    def can_look_ahead(self, requests: list[Request], in_flight: int) -> bool:
        """Whether the next verify of `requests` may be chained to the one in flight, which verifies `in_flight`
        drafts (`cache.lookahead`): it verifies the drafts that one's chain proposes, so only when this step's K is
        the same. A fixed K always is. `k: auto` chooses from the acceptance read so far, one step behind the
        device's (a moving average over many steps: the lag changes little), and chains while K stays; a change of
        K waits for the read. Chained K = 0 steps keep their positions' hidden states for the catch-up as unchained
        ones do, but the catch-up itself runs unchained: a chain stops before any request lags `MAX_BEHIND`."""
        if self.policy is None:
            return self.max_k > 0
        # a bucket's first step times its steps, which would replay graphs whose outputs the chain starts from
        if not self.policy.measured(len(requests)) or self.policy.choose(len(requests)) != in_flight:
            return False
        return in_flight > 0 or all(self._lag(r) + 1 < MAX_BEHIND for r in requests)

    def _lag(self, request: Request) -> int:
        """Positions of `request` that K = 0 steps decoded and the MTP head has not caught up with yet."""
        return len(self._behind[request.id][1]) if request.id in self._behind else 0

    def _catch_up(self, requests: list[Request], draft: bool) -> None:
        """Run the MTP head over the positions K = 0 steps left behind, from the target's hidden states kept
        there (as over prompt chunks, all the requests' spans packed in one forward), writing its KV; with `draft`,
        also draft from the last of them, one chain for all: each request's drafts for the next verify (one host
        read, only when K rises)."""
        if not requests:
            return
        spans, ends = [], [r.num_computed for r in requests]
        for request, end in zip(requests, ends, strict=True):
            first, hidden = self._behind.pop(request.id)  # positions first..end-1 are behind; `end` the last emitted
            spans.append((request, first, request.tokens[first + 1 : end + 1], torch.stack(hidden)))
        last = self.runner.prefill_mtp_spans(spans)  # [B, H] at each request's position end - 1
        if not draft:
            return
        # the chain reads the batch's state rows, pages and sampler rows (its placeholder tokens: none of them)
        batch = self.runner.batch(StepKind.PREFILL, requests, [[FILLER]] * len(requests), ends)
        batch = replace(batch, sampling=self.runner.chain_sampling(requests))
        accepted = torch.zeros(len(requests), dtype=torch.long, device=last.device)
        firsts = [end + 1 - len(r.prompt) for r, end in zip(requests, ends, strict=True)]  # d1: the token at end + 1
        override, use = self._overrides(requests, firsts, accepted, self.max_k)
        drafts = self.runner.chain(batch, last, self.runner.tensor(ends), override, use).tolist()
        for request, row in zip(requests, drafts, strict=True):
            request.drafts = row

    def record(self, request: Request, accepted: int, drafted: int) -> None:
        """A verify's result for `request`: `accepted` of its `drafted` real drafts."""
        request.spec.record(accepted, drafted)
        self.totals.record(accepted, drafted)
        if self.policy is not None:
            self.policy.observe(drafted, accepted)

    # ---- step times (k: auto) ------------------------------------------------------------------------------
    def calibrate(self) -> None:
        """Measure every bucket's step times now (`Engine.warmup`), not at each bucket's first step."""
        if self.policy is not None:
            for bucket in self.policy.buckets:
                self.policy.measure(bucket)

    def agreed_times(self, bucket: int) -> StepTimes:
        """`measure_times`, and under tensor parallelism the same on every rank: each time is the slowest rank's (a
        tensor-parallel step lasts as long as its slowest rank). Every rank's `KPolicy` then sees the same times and
        the same accepted drafts, so it chooses the same K each step, and the ranks' steps (their collectives) stay
        in step. Every rank measures a bucket at the same step (SPMD), so the all-gather meets its partners."""
        times = self.measure_times(bucket)
        parallel = self.runner.model.parallel
        if parallel is None or parallel.group is None:
            return times
        local = torch.tensor([*times.verify, *times.draft], dtype=torch.float64, device=self.runner.device)
        slowest = all_gather(local, parallel.group).amax(dim=0).tolist()
        return StepTimes(tuple(slowest[: len(times.verify)]), tuple(slowest[len(times.verify) :]))

    def measure_times(self, bucket: int, repeats: int = 3) -> StepTimes:
        """The verify and draft step times at `bucket` rows for K = 0..max_k, on padding rows only (the scratch
        state row and page: no request's state is touched), greedy."""
        verify, draft = [], []
        for k in range(self.max_k + 1):
            batch = self._padding_batch(bucket, k + 1)
            hidden, chosen, _ = self.runner.decode(batch)
            verify.append(self._seconds(lambda b=batch: self.runner.decode(b), repeats))
            drafted = replace(batch, token_ids=chosen.clone())
            hidden, accepted = hidden.clone(), torch.zeros(bucket, dtype=torch.long, device=self.runner.device)
            override = torch.zeros(bucket, k, dtype=torch.long, device=self.runner.device)
            args = (drafted, hidden, accepted, override, override.bool())
            timed = k > 0  # a K = 0 step runs no MTP work (`propose`)
            draft.append(self._seconds(lambda a=args: self.runner.draft(*a), repeats) if timed else 0.0)
        return StepTimes(tuple(verify), tuple(draft))

    def _padding_batch(self, size: int, length: int) -> StepBatch:
        """Rows of `length` tokens on the scratch page, each on its own state row where free rows allow
        (`StatePool.timing_rows`: the state traffic of `size` requests). The tokens are spread over the vocabulary
        (a fixed multiplicative hash of their index), so that, as in real traffic, a step's rows and positions
        route to many experts of an MoE model: with one token everywhere they all picked the same experts, and
        the verify at a large K was timed far cheaper than it runs (k: auto then chose that K)."""
        pages, states, device = self.runner.pages, self.runner.states, self.runner.device
        width = pages_for(length + 2 * self.max_k, pages.page_size)
        return StepBatch(
            kind=StepKind.DECODE,
            token_ids=spread_tokens(size, length, self.runner.model.shapes.vocab_size, device),
            positions=torch.arange(length, device=device).expand(size, length).contiguous(),
            state_rows=torch.tensor(states.timing_rows(size), dtype=torch.long, device=device),
            block_tables=torch.full((size, width), pages.scratch_page, dtype=torch.int32, device=device),
            context_lens=torch.full((size,), length, dtype=torch.int32, device=device),
            fresh=False,
        )

    def _seconds(self, run: Callable[[], object], repeats: int) -> float:
        """The fastest of `repeats` timed runs after a warm one (device work included)."""
        sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else (lambda: None)
        run()
        best = float("inf")
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            run()
            sync()
            best = min(best, time.perf_counter() - started)
        return best

    def _overrides(
        self, requests: list[Request], firsts: list[int], accepted: torch.Tensor, k: int, span: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The oracle tokens that replace the head's K = `k` proposals ([B, K]) and where ([B, K] bool). Request
        b's draft i sits at output index `firsts[b] + accepted[b] + i`; the host stages indices firsts[b] ..
        + span - 1 (default 2K: accepted <= K) and the device gathers by `accepted`. The head still runs, so a
        step costs the same."""
        count, device = len(requests), self.runner.device
        if not self.oracle or k == 0:
            zeros = torch.zeros(count, k, dtype=torch.long, device=device)
            return zeros, zeros.bool()
        tokens, use = [], []
        for request, first in zip(requests, firsts, strict=True):
            oracle, draws = self._oracles[request.id]
            window = range(first, first + (span or 2 * k))
            tokens.append([oracle[i] if i < len(oracle) else 0 for i in window])
            use.append([i < len(oracle) and draws[i] for i in window])
        index = accepted[:, None] + torch.arange(k, device=device)
        override = torch.gather(self.runner.tensor(tokens), 1, index)
        return override, torch.gather(self.runner.tensor(use, torch.bool), 1, index)


def spread_tokens(rows: int, length: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, length] token ids, distinct wherever the vocabulary allows, scattered over it by Knuth's
    multiplicative hash of their index (deterministic: the timings do not depend on a generator)."""
    index = torch.arange(rows * length, dtype=torch.long, device=device)
    return ((index * 2654435761 + 40503) % vocab).view(rows, length)
