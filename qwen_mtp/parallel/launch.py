"""Starting the ranks: `qwen-mtp run` / `bench` with `parallel.tp: N` spawn N processes (one per GPU, or N CPU
processes over gloo), each running the same code (SPMD); under `torchrun` the ranks are already there.

What can be checked before anything starts is (`check_recipe`): a degree that does not divide the model's
heads, more ranks than GPUs. A rank that raises prints its error, prefixed with its rank, and exits; the
others then fail in their next collective (at once when the peer's connection closes, else after
`parallel.timeout_s`) and exit too, with a message that says so.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from qwen_mtp.errors import QwenMTPError, RecipeError
from qwen_mtp.recipe import Recipe


class RankFailure(QwenMTPError):
    """A tensor-parallel rank exited with an error (its own message is on stderr, prefixed with its rank)."""


def under_torchrun() -> bool:
    """True inside a process torchrun (or another launcher that sets the env:// variables) started."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def uses_cuda(recipe: Recipe) -> bool:
    device = recipe.model.device
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def check_recipe(recipe: Recipe) -> None:
    """The errors a tensor-parallel recipe can be refused with before any rank starts (RecipeError)."""
    tp = recipe.parallel.tp
    if tp == 1:
        return
    from qwen_mtp.model.shapes import RankShapes

    try:
        RankShapes.of(recipe_model_config(recipe), tp)
    except QwenMTPError as err:
        raise RecipeError(f"parallel.tp: {err}") from None
    if uses_cuda(recipe):
        if recipe.model.device.startswith("cuda:"):
            raise RecipeError(
                f"model.device {recipe.model.device!r} names one GPU but parallel.tp={tp} puts rank r on cuda:r: "
                "use model.device cuda (or auto)"
            )
        count = torch.cuda.device_count()
        if not under_torchrun() and tp > count:
            raise RecipeError(f"parallel.tp={tp} needs {tp} GPUs, one per rank, but {count} are visible")


def recipe_model_config(recipe: Recipe):
    """The model config a recipe names (its checkpoint's, fixture's or synthetic preset's), without loading weights."""
    from qwen_mtp.config import ModelConfig

    model = recipe.model
    if model.synthetic is not None:
        from qwen_mtp.testing.synthetic import synthetic_config

        return synthetic_config(model.synthetic)
    if model.fixture is not None:
        from qwen_mtp.testing import fixture_path

        return ModelConfig.from_pretrained(fixture_path(model.fixture, seed=model.seed))
    return ModelConfig.from_pretrained(os.path.expanduser(model.path))


def run_ranks(recipe: Recipe, target: Callable[..., Any], *args: Any) -> None:
    """Run `target(*args)` on every rank of `recipe.parallel.tp` (in this process alone when tp = 1; in this
    process as the rank torchrun made it; else in tp spawned processes, this one waiting for them). `target`
    must be a module-level function (spawned processes import it); inside it, `parallel.current(tp)` is the
    rank. Raises RankFailure when a spawned rank fails."""
    tp = recipe.parallel.tp
    check_recipe(recipe)
    if tp == 1:
        target(*args)
        return
    backend = "nccl" if uses_cuda(recipe) else "gloo"
    timeout = recipe.parallel.timeout_s
    if under_torchrun():
        _rank_main(int(os.environ["RANK"]), tp, "env://", backend, timeout, target, args)
        return
    import torch.multiprocessing as mp

    try:
        ranks = spawn_ranks(tp, backend, timeout, target, args)
        with _signals_passed_to_ranks(ranks):
            while not ranks.join():  # returns each time one rank exits, True once all have
                pass
    except mp.ProcessExitedException as err:
        raise RankFailure(
            f"rank {err.error_index} of {tp} exited with code {err.exit_code}; see its message above"
        ) from None


@contextlib.contextmanager
def _signals_passed_to_ranks(ranks) -> Iterator[None]:
    """While this process waits for its spawned ranks: a SIGTERM goes on to rank 0, which stops the run (a server
    stops gracefully and tells the other ranks; a `run` or `bench` rank dies and the wait stops the rest), and a
    SIGINT goes on to every rank, as Ctrl-C in a terminal does (a server's rank 0 stops, a second one forces it;
    the other ranks follow it), unless it came from that terminal: then every rank has it already. Without this
    the ranks would outlive a terminated parent, or run on after `kill -INT` to it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame) -> None:
        if ranks.processes[0].is_alive():
            os.kill(ranks.processes[0].pid, signal.SIGTERM)

    def interrupt(signum, frame) -> None:
        if not _terminal_interrupts_ranks():
            for process in ranks.processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGINT)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, forward)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _terminal_interrupts_ranks() -> bool:
    """Whether this process group is its terminal's foreground group: a Ctrl-C there reaches the spawned ranks
    (which share the group) by itself. False without a controlling terminal."""
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


def spawn_ranks(tp: int, backend: str, timeout: float, target: Callable[..., Any], args: tuple):
    """Start `tp` rank processes on this machine running `target(*args)` and return at once: a
    `torch.multiprocessing` ProcessContext (`join()` waits for them and stops the rest when one fails)."""
    import torch.multiprocessing as mp

    init = f"tcp://127.0.0.1:{free_port()}"
    return mp.start_processes(
        _rank_main, (tp, init, backend, timeout, target, args), nprocs=tp, join=False, start_method="spawn"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, tp: int, init: str, backend: str, timeout: float, target, args) -> None:
    """One rank: join the group (with its timeout), run `target`, leave; on an error, say which rank and exit."""
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # the ranks share the machine's cores
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        dist.init_process_group(
            backend, init_method=init, rank=rank, world_size=tp, timeout=datetime.timedelta(seconds=timeout)
        )
        target(*args)
    except BaseException as err:  # noqa: BLE001  (a rank's whole life: every failure is reported, then exits)
        _report(rank, tp, timeout, err)
        sys.stderr.flush()
        os._exit(2 if isinstance(err, QwenMTPError) else 1)  # do not wait on peers that may be gone
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(rank: int, tp: int, timeout: float, err: BaseException) -> None:
    if isinstance(err, QwenMTPError):
        print(f"error: rank {rank} of {tp}: {err}", file=sys.stderr)
        return
    traceback.print_exception(err, file=sys.stderr)
    print(
        f"error: rank {rank} of {tp} stopped: {type(err).__name__}: {err}\n"
        f"(a collective fails when another rank died, or waited longer than parallel.timeout_s={timeout:g} s; "
        "the first rank to fail says why)",
        file=sys.stderr,
    )
