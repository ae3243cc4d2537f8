"""Serving under tensor parallelism: rank 0 runs the HTTP server and the engine loop; every other rank runs the same
engine and, before each of rank 0's steps, applies what rank 0 applied (the requests it took in, the ones it
cancelled), then steps with it.

Every rank's scheduler then takes the same decisions from the same inputs, as in `qwen-mtp run` (docs/parallel.md
"SPMD"): the requests enter each engine in the same order with the same (seeded) parameters, and a cancellation or
a timeout applies between the same two steps on every rank. The messages are `torch.distributed` broadcasts over a
gloo group of their own: host memory, never on the GPU stream, and apart from the NCCL group the model's
collectives use. Rank 0 sends one message a step, and one every `heartbeat_s` while idle, so a waiting rank never
reaches the group's timeout. A message is one broadcast of a three-integer header; requests and cancellations, when
there are any, follow pickled in a second one (what `broadcast_object_list` sends, without its size broadcast on
every step), so the other ranks start each step about one broadcast's latency after rank 0
(benchmarks/relay_latency.py).
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwen_mtp.engine import Engine, SamplingParams
from qwen_mtp.parallel.group import TensorParallel


@dataclass(frozen=True)
class Tick:
    """What rank 0 applied before one pass of its loop: requests it submitted (its loop's id, the prompt, the
    parameters with the seed its engine drew), loop ids it cancelled, whether it steps now, whether it stops."""

    submitted: tuple[tuple[int, list[int], SamplingParams], ...] = ()
    cancelled: tuple[int, ...] = ()
    step: bool = False
    stop: bool = False


class Relay:
    """Rank 0 -> every rank: one `Tick` a loop pass. Made on every rank at once (its group is a collective)."""

    def __init__(self, parallel: TensorParallel, timeout_s: float):
        self.parallel = parallel
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.heartbeat_s = min(1.0, timeout_s / 4)  # rank 0 idle: the longest it waits before sending an empty tick
        pids: list[int | None] = [None] * parallel.degree
        dist.all_gather_object(pids, os.getpid(), group=self.group)
        self.pids = tuple(pids)  # every rank's process id, by rank (rank 0 logs them: which process is which)

    def send(self, tick: Tick) -> None:
        changes = pickle.dumps((tick.submitted, tick.cancelled)) if tick.submitted or tick.cancelled else b""
        header = torch.tensor([tick.step, tick.stop, len(changes)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        if changes:
            dist.broadcast(torch.frombuffer(bytearray(changes), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> Tick:
        header = torch.empty(3, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        step, stop, size = header.tolist()
        if not size:
            return Tick(step=bool(step), stop=bool(stop))
        changes = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(changes, src=0, group=self.group)
        submitted, cancelled = pickle.loads(changes.numpy().tobytes())
        return Tick(submitted, cancelled, bool(step), bool(stop))


class RankDiverged(RuntimeError):
    """A rank's engine disagrees with rank 0's about whether there is work (a bug: the ranks must stay in step)."""


def follow(engine: Engine, relay: Relay) -> None:
    """A rank other than 0, until rank 0 stops: apply each tick, step when rank 0 steps, and read every finished
    request's result (which frees it here; rank 0 sends it to its client). Ctrl-C in a terminal reaches every rank:
    this one leaves the stopping to rank 0, which tells it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine_ids: dict[int, int] = {}  # rank 0's loop id -> this engine's id
    loop_ids: dict[int, int] = {}  # the reverse
    while True:
        tick = relay.receive()
        for loop_id, prompt, params in tick.submitted:
            engine_id = engine.submit(prompt, params)
            engine_ids[loop_id], loop_ids[engine_id] = engine_id, loop_id
        for loop_id in tick.cancelled:
            engine_id = engine_ids.pop(loop_id)
            engine.cancel(engine_id)
            engine.result(engine_id)
            del loop_ids[engine_id]
        if tick.stop:
            return
        if tick.step != engine.has_unfinished():
            raise RankDiverged(
                f"rank {relay.parallel.rank}: rank 0 {'steps' if tick.step else 'is idle'} but this rank "
                f"{'has no' if tick.step else 'has'} unfinished requests"
            )
        if tick.step:
            for update in engine.step():
                if update.finished:
                    engine.result(update.request_id)
                    del engine_ids[loop_ids.pop(update.request_id)]
