"""One generation worker for the one loaded model.

Requests wait in a bounded queue (full: the caller answers 503/529). The worker thread runs one
generation at a time and hands its chunks to the request's event loop; a request whose client
went away sets ``cancelled`` and the worker stops that generation at the next chunk.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

if TYPE_CHECKING:
    from ..api import GenerationRequest
    from .common import ServedModel

_DONE = object()


class QueueFull(Exception):
    pass


@dataclass
class Job:
    prompt: list[int]  # token ids
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    async def chunks(self) -> AsyncIterator:
        """The generation's chunks; raises what the generation raised."""
        while True:
            item = await self.out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Worker:
    def __init__(self, spec: ServedModel, max_queue: int):
        self.spec = spec
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="mlxspec-generation", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting plus the one running."""
        return self.jobs.qsize() + int(self.busy)

    def submit(self, prompt: list[int], request: GenerationRequest) -> Job:
        job = Job(prompt, request, asyncio.get_running_loop())
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        return job

    def _send(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the request's loop is gone (server shutting down)
            job.cancel()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                continue
            self.busy = True
            stream = None
            try:
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
                self.busy = False
