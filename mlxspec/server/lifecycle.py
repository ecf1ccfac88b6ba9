"""Running the app under uvicorn with a bounded graceful shutdown.

The first SIGTERM or SIGINT stops accepting connections and lets running requests finish for
up to ``grace`` seconds; then every generation still running or waiting ends with a 503 ("the
server is shutting down"; in-band on a stream that has started), and uvicorn cancels what is
left a moment later. A second signal stops at once. A shutdown asked for by a signal exits 0:
the server did what it was told (uvicorn would raise the signal again and exit 143 or 130).
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType

import uvicorn

from ..options import ACCEPT_BACKLOG, DEFAULT_SHUTDOWN_GRACE, KEEP_ALIVE_TIMEOUT, MAX_HEADER_BYTES
from .common import APIError
from .limits import Limits, guarded_protocol, limit_repeated_log_lines

BACKSTOP = 2.0  # seconds after the grace before uvicorn cancels the requests still there


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float):
        super().__init__(config)
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig in (signal.SIGINT, signal.SIGTERM):
            self.force_exit = True  # the second one: do not wait any more
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.stop_generations)
        else:
            self.should_exit = True
        # not recorded in _captured_signals: uvicorn would raise it again once shut down

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.grace, self.stop_generations)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
        if self.force_exit:  # the requests just got their 503: a moment to send it
            for _ in range(20):
                if not self.server_state.tasks:
                    break
                await asyncio.sleep(0.05)
            await self.lifespan.shutdown()  # (uvicorn skips it when forced; this app's is instant)

    def stop_generations(self) -> None:
        server = getattr(getattr(self.config.app, "state", None), "server", None)
        if server is not None:
            server.worker.stop(APIError(503, "the server is shutting down", kind="overloaded_error"))


def config(app, host: str, port: int, *, log_level: str = "info", use_colors: bool | None = None,
           grace: float = DEFAULT_SHUTDOWN_GRACE) -> uvicorn.Config:
    """uvicorn's configuration for APP, bounded by its limits (app.state.limits: connections and
    the time their headers take, in the protocol; a request line and headers MAX_HEADER_BYTES;
    connections accepted at once ACCEPT_BACKLOG)."""
    limits = getattr(getattr(app, "state", None), "limits", None) or Limits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, use_colors=use_colors,
                          timeout_graceful_shutdown=grace + BACKSTOP, http=guarded_protocol(limits),
                          timeout_keep_alive=KEEP_ALIVE_TIMEOUT, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          backlog=ACCEPT_BACKLOG)


def serve(app, host: str, port: int, *, log_level: str = "info", use_colors: bool | None = None,
          grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
    """Serve APP until a signal; running requests get GRACE seconds to finish. The same log
    line repeated (a flood of failing clients) is written a few times a minute, then counted."""
    limit_repeated_log_lines()
    GracefulServer(config(app, host, port, log_level=log_level, use_colors=use_colors, grace=grace), grace).run()
