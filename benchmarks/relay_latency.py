"""What tensor-parallel serving adds to a step: the time of one `Relay` message (serve/relay.py) from rank 0 to
rank 1 over gloo on this machine, an empty pass (the steady state) and one carrying a new request with a long
prompt. Two local processes, back-to-back messages; prints a table and writes JSON.

    python benchmarks/relay_latency.py --out docs/img/relay-latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from qwen_mtp.engine import SamplingParams
from qwen_mtp.parallel.group import TensorParallel
from qwen_mtp.parallel.launch import spawn_ranks
from qwen_mtp.serve.relay import Relay, Tick

CASES = {
    "empty pass (a step, nothing new)": Tick(step=True),
    "a new request, 2048-token prompt": Tick(((0, list(range(2048)), SamplingParams(64, seed=1)),), step=True),
    "a cancellation": Tick(cancelled=(0,), step=True),
}


def measure(out: str, messages: int) -> None:
    rank = dist.get_rank()
    relay = Relay(TensorParallel(rank, 2, rank, dist.group.WORLD), 60.0)
    rows = []
    for name, tick in CASES.items():
        for _ in range(messages // 10):  # warm-up
            relay.send(tick) if rank == 0 else relay.receive()
        dist.barrier(group=relay.group)
        started = time.perf_counter()
        for _ in range(messages):
            if rank == 0:
                relay.send(tick)
            else:
                assert relay.receive() == tick
        dist.barrier(group=relay.group)
        rows.append({"case": name, "us_per_message": (time.perf_counter() - started) / messages * 1e6})
    if rank == 0:
        Path(out).write_text(json.dumps({"machine": _machine(), "messages": messages, "rows": rows}, indent=2))


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "processor": platform.processor(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="relay-latency.json")
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args()
    ranks = spawn_ranks(2, "gloo", 60.0, measure, (args.out, args.messages))
    while not ranks.join():
        pass
    report = json.loads(Path(args.out).read_text())
    print(f"relay messages rank 0 -> rank 1 over gloo ({report['machine']['cpus']} CPUs, back to back):")
    for row in report["rows"]:
        print(f"  {row['case']:<36} {row['us_per_message']:8.1f} us")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
