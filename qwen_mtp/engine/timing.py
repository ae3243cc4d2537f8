"""Where a step's time goes (prefill / decode / verify / draft), for `qwen-mtp bench`. Off by default: when
on, each phase synchronizes the device so its time is its own."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, enabled: bool = False, device: torch.device | None = None):
        self.enabled = enabled
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()
