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
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of prompt + output whose KV and state are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"

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
