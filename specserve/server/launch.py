"""Run the API under uvicorn: ``serve`` in the foreground, ``start_server_in_thread`` for tests.

uvicorn runs the app's lifespan, which starts the engine loop inside the server's event loop and shuts it
down when the server stops (Ctrl-C / SIGTERM for ``serve``, ``stop_fn()`` for the threaded server).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from specserve.server.api import build_app


def serve(async_engine: Any, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          log_level: str = "info", **app_kwargs: Any) -> None:
    """Serve ``async_engine`` over HTTP until interrupted; ``app_kwargs`` go to ``build_app``."""
    app = build_app(async_engine, served_model_name, **app_kwargs)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()


def start_server_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                           log_level: str = "warning",
                           startup_timeout_s: float = 60.0) -> tuple[str, Callable[[], None]]:
    """Start ``app`` in a daemon thread on ``host:port`` (0: a free port); return (base_url, stop_fn).

    Blocks until the server accepts connections (lifespan startup done). ``stop_fn`` asks uvicorn to exit
    gracefully (lifespan shutdown runs, which shuts the engine down) and joins the thread.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    thread = threading.Thread(target=run, name=f"uvicorn-{bound_port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()
            raise RuntimeError(f"server failed to start on {host}:{bound_port}") from (errors[0] if errors
                                                                                      else None)
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    url_host = f"[{host}]" if ":" in host else host
    return f"http://{url_host}:{bound_port}", stop
