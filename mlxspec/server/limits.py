"""What a client may hold of the server without a key: connections, the time to send a request's
headers, and the log lines its failures write.

uvicorn bounds neither the connections it accepts nor the time a request's headers take
(``limit_concurrency`` answers 503 only once a request's headers are in, and a byte now and
then keeps a connection open for ever): :func:`guarded_protocol` is uvicorn's h11 protocol with
both bounds. The bounds on bodies (size, time, bytes buffered across requests) are the ASGI
middleware's (``middleware.BodyLimit``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..options import (
    BODY_TIMEOUT,
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    HEADER_TIMEOUT,
    LOG_REPEAT_WINDOW,
    LOG_REPEATS,
)

# raw answers written on a connection no request of which reached the app
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_FULL = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class Limits:
    """The server's bounds on what clients hold (options.py says why each default)."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = HEADER_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, bounded: at most ``limits.max_connections`` open (past it, the
    connection that has waited longest for a request's headers is closed to make room, so a
    health check still gets in; when every one is busy with a request, the newcomer gets a 503),
    and a request's headers must be in within ``limits.header_timeout`` of its first byte (or
    of the connection opening), else a 408 and the connection closes."""

    limits = Limits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm_header_timer()
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers():
            self._arm_header_timer()
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm_header_timer()  # the next request's first byte arms it again
        self._waiting_since = time.monotonic()
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        """No request of this connection is with the app: it is new, or idle between requests."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._waiting_since = time.monotonic()
            self._header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_overdue)

    def _disarm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers():
            self._close_with(_TIMED_OUT)

    def _close_with(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()

    def _make_room(self) -> None:
        """Close the connection that has waited longest for its request's headers, else this new one."""
        waiting = [c for c in self.connections if c is not self and isinstance(c, GuardedH11)
                   and c._waiting_for_headers() and not c.transport.is_closing()]
        if waiting:
            min(waiting, key=lambda c: c._waiting_since)._close_with(_TIMED_OUT)
        else:
            self._close_with(_FULL)


def guarded_protocol(limits: Limits) -> type[GuardedH11]:
    """GuardedH11 with LIMITS, for uvicorn.Config(http=...)."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits})


class RepeatLimit(logging.Filter):
    """Lets the same warning or error (logger, level, text) through at most REPEATS times per
    WINDOW seconds; the rest are counted, and the count goes out with the next one let through.
    A full file handle table made asyncio log every failed accept: 487k lines in 50 s. Lines
    under WARNING (the request log) all go through."""

    def __init__(self, repeats: int = LOG_REPEATS, window: float = LOG_REPEAT_WINDOW, clock=time.monotonic):
        super().__init__()
        self.repeats, self.window, self.clock = repeats, window, clock
        self._seen: dict[tuple, list] = {}  # key -> [window start, let through, held back]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.getMessage())
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or now - seen[0] >= self.window:
            held = seen[2] if seen else 0
            self._seen[key] = [now, 1, 0]
            if len(self._seen) > 1000:  # lines that differ are let through: bound the table they fill
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window or k == key}
            if held:
                record.msg, record.args = f"{key[2]} (and {held} more like it in the last {self.window:g} s, " \
                                          "not logged)", None
            return True
        if seen[1] < self.repeats:
            seen[1] += 1
            return True
        seen[2] += 1
        return False


# where a flood of failing clients writes: asyncio (accept errors), uvicorn (protocol errors,
# the concurrency limit's warning), this server's own request log
FLOODED_LOGGERS = ("asyncio", "uvicorn.error", "mlxspec.server")


def limit_repeated_log_lines(repeats: int = LOG_REPEATS, window: float = LOG_REPEAT_WINDOW) -> RepeatLimit:
    """Install one RepeatLimit on FLOODED_LOGGERS (once: a second call replaces nothing)."""
    for name in FLOODED_LOGGERS:
        existing = [f for f in logging.getLogger(name).filters if isinstance(f, RepeatLimit)]
        if existing:
            return existing[0]
    limit = RepeatLimit(repeats, window)
    for name in FLOODED_LOGGERS:
        logging.getLogger(name).addFilter(limit)
    return limit
