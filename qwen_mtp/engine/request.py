"""One generation request: its tokens, its progress through prefill and decode, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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

    def record(self, accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += self.k
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


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of prompt + output whose KV and state are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    spec: SpecStats | None = None  # set when the request decodes speculatively
    drafts: list[int] = field(default_factory=list)  # the next verify's draft tokens d1..dK
    oracle: list[int] | None = None  # plain-greedy continuation, for oracle drafts

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def max_len(self) -> int:
        """Most positions this request can ever occupy in the cache."""
        return len(self.prompt) + self.max_new_tokens

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED)
