"""Run the app under uvicorn on a socket bound here (so `server.port: 0` reports the port it got), and make a
SIGTERM a graceful stop that exits 0: stop accepting, let running requests finish for `server.shutdown_grace_s`,
cancel the rest."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable

import uvicorn

from qwen_mtp.engine import Engine
from qwen_mtp.recipe import ServerSection
from qwen_mtp.serve.app import create_app


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def uvicorn_server(engine: Engine, settings: ServerSection, log: Callable[[str], None] = print) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(engine, settings, log),
        log_level="warning",
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # seconds (uvicorn takes a float here too)
        lifespan="on",
    )
    return uvicorn.Server(config)


def serve(engine: Engine, settings: ServerSection, log: Callable[[str], None] = print) -> None:
    """Serve until SIGTERM or SIGINT; returns normally after a graceful stop."""
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn_server(engine, settings, log)
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
    log("server stopped")
