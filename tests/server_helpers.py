"""Run an ASGI app on a real uvicorn server on 127.0.0.1 (a free port) in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(app, timeout: float = 30.0):
    """Yield the base URL (``http://127.0.0.1:PORT``) of APP served by uvicorn; stop it after."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # not the main thread (older uvicorn calls this)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited before it started")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"uvicorn did not start within {timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


def start_server(app) -> tuple[str, object]:
    """Non-context-manager form: (base_url, stop) where ``stop()`` shuts the server down."""
    cm = running(app)
    url = cm.__enter__()
    return url, lambda: cm.__exit__(None, None, None)


def until(check, seconds: float = 5.0) -> bool:
    """Whether CHECK() comes true within SECONDS (polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()
