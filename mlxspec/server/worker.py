"""One generation worker for the one loaded model.

Requests wait in a bounded queue (full: the caller answers 503/529); ``max_queue`` of them may
wait while one runs, 0 letting none wait. The worker thread runs one generation at a time and
hands its chunks to the request's event loop. A request whose client went away cancels its
job: a waiting job leaves the queue at once, a running one stops at the next chunk.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

if TYPE_CHECKING:
    from ..api import GenerationRequest
    from .common import ServedModel

_DONE = object()


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    prompt: list[int]  # token ids
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    withdraw: Callable[[Job], None] | None = None  # takes a waiting job out of the queue

    def cancel(self) -> None:
        self.cancelled.set()
        if self.withdraw is not None:
            self.withdraw(self)

    async def chunks(self, gone: Callable[[], Awaitable[bool]] | None = None,
                     every: float = 0.1) -> AsyncIterator:
        """The generation's chunks; raises what the generation raised. With GONE (whether the
        client left), it is asked every EVERY seconds, queued or running, and at each chunk:
        when it says so the job is cancelled and the chunks end."""
        while True:
            try:
                if not self.out.empty() or gone is None:
                    item = await self.out.get()
                else:
                    item = await asyncio.wait_for(self.out.get(), every)
            except asyncio.TimeoutError:
                item = None
            if gone is not None and await gone():
                self.cancel()
                return
            if item is None:
                continue
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Worker:
    def __init__(self, spec: ServedModel, max_queue: int):
        self.spec = spec
        self.max_queue = max_queue
        self._waiting: deque[Job] = deque()
        self._ready = threading.Condition()
        self.busy = False
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._run, name="mlxspec-generation", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting plus the one running."""
        return len(self._waiting) + int(self.busy)

    def submit(self, prompt: list[int], request: GenerationRequest) -> Job:
        job = Job(prompt, request, asyncio.get_running_loop(), withdraw=self._withdraw)
        with self._ready:
            # an idle worker takes the next job at once: one more than max_queue may be in line
            if len(self._waiting) >= self.max_queue + (0 if self.busy else 1):
                raise QueueFull
            self._waiting.append(job)
            self._ready.notify()
        return job

    def _withdraw(self, job: Job) -> None:
        with self._ready:
            try:
                self._waiting.remove(job)
            except ValueError:  # running or done
                pass

    def stop(self, err: BaseException) -> None:
        """End every job, waiting or running, with ERR (the server is shutting down)."""
        with self._ready:
            jobs = list(self._waiting) + ([self._running] if self._running is not None else [])
            self._waiting.clear()
        for job in jobs:
            job.cancel()
            self._send(job, err)

    def _next(self) -> Job:
        with self._ready:
            while not self._waiting:
                self._ready.wait()
            self.busy = True
            self._running = self._waiting.popleft()
            return self._running

    def _send(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the request's loop is gone (server shutting down)
            job.cancel()

    def _run(self) -> None:
        while True:
            job = self._next()
            stream = None
            try:
                if job.cancelled.is_set():
                    continue
                stream = self.spec.stream(prompt=job.prompt, request=job.request)
                for chunk in stream:
                    if job.cancelled.is_set():
                        break
                    self._send(job, chunk)
                self._send(job, _DONE)
            except Exception as err:  # handed to the request, which answers with it
                self._send(job, err)
            finally:
                if stream is not None:
                    stream.close()
                with self._ready:
                    self.busy, self._running = False, None
