"""Run the app under uvicorn on a socket bound here (so `server.port: 0` reports the port it got), and make a
SIGTERM a graceful stop that exits 0: stop accepting, let running requests finish for `server.shutdown_grace_s`,
cancel the rest. Under tensor parallelism this runs on rank 0 (the other ranks follow it: relay.py)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable

import uvicorn

from qwen_mtp.engine import Engine
from qwen_mtp.errors import QwenMTPError
from qwen_mtp.recipe import ServerSection
from qwen_mtp.serve.app import create_app
from qwen_mtp.serve.relay import Relay


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class ServerFailed(QwenMTPError):
    """The engine loop stopped (under tensor parallelism a failed step or a lost rank; at any degree, a bug in the
    loop itself), and the server with it."""


def uvicorn_server(
    engine: Engine, settings: ServerSection, log: Callable[[str], None] = print, relay: Relay | None = None
) -> uvicorn.Server:
    """The server for `engine`; it stops by itself if its engine loop fails (`app.state.engine_loop.failed`)."""
    app = create_app(engine, settings, log, relay)
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # seconds (uvicorn takes a float here too)
        lifespan="on",
    )
    server = uvicorn.Server(config)
    app.state.engine_loop.on_failure = lambda: setattr(server, "should_exit", True)
    return server


def serve(
    engine: Engine, settings: ServerSection, log: Callable[[str], None] = print, relay: Relay | None = None
) -> None:
    """Serve until SIGTERM or SIGINT; returns normally after a graceful stop, raises `ServerFailed` when the engine
    loop stopped the server (the process then exits with status 2)."""
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn_server(engine, settings, log, relay)
    shown = f"[{host}]" if ":" in host else host
    log(f"serving {settings.model_name!r} on http://{shown}:{port}/v1 (OpenAI API; /metrics, /health)")
    # uvicorn re-raises the signal that stopped it once it has shut down, with the handler it found installed:
    # a no-op one here, so a graceful stop ends the process with status 0 instead of dying by the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    failed = server.config.app.state.engine_loop.failed
    if failed is not None:
        raise ServerFailed(f"the server stopped: its engine loop failed ({type(failed).__name__}: {failed})")
    log("server stopped")
