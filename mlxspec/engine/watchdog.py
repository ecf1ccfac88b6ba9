"""A bound on how long a step of a sharded run may take: a peer that hangs.

A peer whose process dies closes its sockets and the backend fails the next collective (a
one-line error, models/sharding.py). One that hangs without closing them (stopped, a machine
that lost power, a pulled cable) leaves the others waiting in a collective for ever, inside
MLX's C++ where no Python exception reaches them. So while a step of a sharded generation is
in flight (the seed's exchange, each prefill chunk, each step and the per-step check,
engine/ranks.py) a thread watches the clock: when no step has finished for
``MLXSPEC_PEER_TIMEOUT`` seconds (default 300) it prints one line and ends the process with
code 1 (``os._exit``: the main thread is stuck in C++). A serve follower idle between requests
is watched too: rank 0 meets it every tick (server/sharded.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from ..errors import UsageError

TIMEOUT_ENV = "MLXSPEC_PEER_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def timeout_s() -> float:
    """The seconds a step may take, from $MLXSPEC_PEER_TIMEOUT (UsageError when it is not a
    positive number)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise UsageError(f"{TIMEOUT_ENV} must be a number of seconds above 0 (got {raw!r})")
    return value


def exit_now(code: int, line: str | None = None) -> None:
    """End this process with CODE at once: LINE (if any) on stderr, output flushed, and no
    interpreter teardown (``os._exit``): a sharded run's main thread may be stuck in C++, and
    in the teardown MLX's state was seen destroyed under a thread still collecting garbage."""
    if line is not None:
        sys.stderr.write(line + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fire(seconds: float) -> None:
    exit_now(1, f"error: no step of the sharded run finished in {seconds:g} s: another process is not "
                "answering (hung or unreachable); stopping")


class Watchdog:
    """Armed while a step is in flight (:meth:`watching`, nested freely on one thread), fed by
    every step that finishes (:meth:`progress`); FIRE(timeout) once a step overruns."""

    def __init__(self, fire: Callable[[float], None] = _fire, clock: Callable[[], float] = time.monotonic):
        self.fire, self.clock = fire, clock
        self._lock = threading.Lock()
        self._depth = 0
        self._deadline: float | None = None
        self._timeout = DEFAULT_TIMEOUT_S
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    @contextmanager
    def watching(self, limit: float | None = None) -> Iterator[None]:
        """Armed for the block: a step must finish within $MLXSPEC_PEER_TIMEOUT seconds, or
        LIMIT when that is shorter (an outermost block's bound holds for the blocks inside)."""
        timeout = timeout_s() if limit is None else min(timeout_s(), limit)
        with self._lock:
            if self._depth == 0:
                self._timeout = timeout
                self._deadline = self.clock() + timeout
            self._depth += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="mlxspec-peer-watchdog", daemon=True)
                self._thread.start()
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._deadline = None

    def progress(self) -> None:
        """A step finished: the next one has the whole timeout again."""
        with self._lock:
            if self._deadline is not None:
                self._deadline = self.clock() + self._timeout

    def overdue(self) -> bool:
        """Whether the step in flight has overrun (FIRE is called when so)."""
        with self._lock:
            late = self._deadline is not None and self.clock() > self._deadline
            timeout = self._timeout
        if late:
            self.fire(timeout)
        return late

    def _watch(self) -> None:
        while True:
            with self._lock:
                deadline = self._deadline
            if deadline is None:  # nothing in flight: sleep until something is
                self._wake.wait()
                self._wake.clear()
                continue
            time.sleep(min(max(deadline - self.clock(), 0.05), 1.0))
            self.overdue()


WATCHDOG = Watchdog()
watching = WATCHDOG.watching
progress = WATCHDOG.progress
