"""One generation request: its tokens, its progress through prefill and decode, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from qwen_mtp.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass
class SpecStats:
    """Speculation figures of one request: drafts proposed and accepted, per verify step and per position."""

    k: int
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    position_accepted: list[int] = field(default_factory=list)  # [k]: steps whose draft i was accepted
    accept_lengths: list[int] = field(default_factory=list)  # per verify step: accepted drafts + 1 (bonus)

    def __post_init__(self) -> None:
        self.position_accepted = self.position_accepted or [0] * self.k

    def record(self, accepted: int, drafted: int | None = None) -> None:
        """One verify step that checked `drafted` drafts (default k; fewer when K changes per step)."""
        self.verify_steps += 1
        self.drafted += self.k if drafted is None else drafted
        self.accepted += accepted
        for i in range(accepted):
            self.position_accepted[i] += 1
        self.accept_lengths.append(accepted + 1)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens gained per verify step (accepted drafts + the bonus token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        return [a / self.verify_steps if self.verify_steps else 0.0 for a in self.position_accepted]


class Request:
    """A request's tokens and progress. Only the scheduler (admission) and `update.py` (everything a step or a
    cancellation changes) write these fields; the runner and the speculator only read them."""

    def __init__(self, id: int, prompt: list[int], params: SamplingParams):
        self.id = id
        self.prompt = prompt
        self.params = params
        self.tokens = list(prompt)  # prompt + output, appended to as tokens are emitted (never rebuilt)
        self.status = Status.WAITING
        self.num_computed = 0  # leading tokens whose KV and state are in the cache
        self.finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
        self.error: BaseException | None = None  # what a failed step raised
        self.spec: SpecStats | None = None  # set when the request decodes speculatively
        self.drafts: list[int] = []  # the next verify's draft tokens d1..dK
        # the llguidance matcher of a structured output (`grammar.py`): set at submit, advanced by update.py alone
        self.grammar: Any | None = None
        self.cached_tokens = 0  # leading prompt positions restored from the prefix cache at admission
        # A prefix-cache fill (internal, never returned): prefill the prompt's full chunks up to `fill_end` to
        # cache a finished request's output with prefill numbers, then end. None for user requests.
        self.fill_end: int | None = None
        # one per output token / per prompt position (None for the first), when the request asks for them
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None

    @property
    def output(self) -> list[int]:
        """The generated tokens (a copy: read it for results, not on the step path)."""
        return self.tokens[len(self.prompt) :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def max_len(self) -> int:
        """Most tokens this request can ever hold (prompt + max_new_tokens)."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED)
