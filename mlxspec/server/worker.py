"""One generation worker for the one loaded model.

Requests wait in a bounded queue (full: the caller answers 503/529); ``max_queue`` of them may
wait while the running ones run, 0 letting none wait. The worker thread hands each job's
chunks to the request's event loop. A request whose client went away cancels its job: a
waiting job leaves the queue at once, a running one stops at its next chunk.

With ``max_batch`` > 1, up to that many jobs run together as rows of one batch
(``SpecModel.stream_in``, engine/batch.py): jobs join between steps, and the worker takes one
chunk from each running job in turn (a row with no tokens waiting steps the whole batch). A
job the batch cannot take (``SpecModel.batch_plan``: e.g. a model drafter, constrained
output) runs alone once the rows before it are done; the jobs behind it wait (first come,
first served).

A sharded target (mlx.launch) is run through server/sharded.py's ``Leader``: one job at a time,
each handed to the other ranks first; :meth:`Worker.close` ends the worker thread and then
the followers.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterator

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
    # how it decodes as a batch row (SpecModel.batch_plan, asked once): None not asked yet,
    # False it runs alone
    plan: object = None

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
    def __init__(self, spec: ServedModel, max_queue: int, max_batch: int = 1):
        self.spec = spec
        self.max_queue = max_queue
        # batching needs the model's batch engine (a test's stand-in model may have none)
        self.max_batch = max_batch if hasattr(spec, "stream_in") else 1
        self._waiting: deque[Job] = deque()
        self._ready = threading.Condition()
        self._running: list[Job] = []
        self._batch = None  # the batch engine, once the worker runs one
        self._closed = False  # close(): the thread ends once nothing runs
        self._thread = threading.Thread(target=self._run, name="mlxspec-generation", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def batch_steps(self) -> int:
        """Batched forwards run (for /metrics)."""
        return self._batch.steps if self._batch is not None else 0

    @property
    def batch_row_steps(self) -> int:
        """Rows those batched forwards served, summed."""
        return self._batch.row_steps if self._batch is not None else 0

    @property
    def depth(self) -> int:
        """Requests waiting plus those running."""
        return len(self._waiting) + len(self._running)

    def submit(self, prompt: list[int], request: GenerationRequest) -> Job:
        job = Job(prompt, request, asyncio.get_running_loop(), withdraw=self._withdraw)
        with self._ready:
            # free rows take the next jobs at once: that many more than max_queue may be in line
            if len(self._waiting) >= self.max_queue + max(self.max_batch - len(self._running), 0):
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
            jobs = list(self._waiting) + self._running
            self._waiting.clear()
        for job in jobs:
            job.cancel()
            self._send(job, err)

    def _send(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the request's loop is gone (server shutting down)
            job.cancel()

    def _finish(self, job: Job) -> None:
        with self._ready:
            if job in self._running:
                self._running.remove(job)

    def close(self, timeout: float | None = None) -> bool:
        """End the worker thread once no job waits or runs (:meth:`stop` ends them at once),
        then call the model's ``finish()`` if it has one (a sharded target's: the followers
        stop); waits up to TIMEOUT seconds (None: until done). Whether the thread ended."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        if self.max_batch > 1:
            self._run_batched()
        # a sharded target's leader meets its followers each tick while nothing waits (server/sharded.py)
        idle = getattr(self.spec, "idle", None)
        while True:
            with self._ready:
                if not self._waiting and not self._closed:
                    self._ready.wait(None if idle is None else self.spec.idle_tick_s)
                if self._closed and not self._waiting:
                    break
                job = self._waiting.popleft() if self._waiting else None
                if job is not None:
                    self._running.append(job)
            if job is None:  # a tick with nothing to do (or a spurious wake-up)
                if idle is not None:
                    idle()
                continue
            self._run_alone(job)
        finish = getattr(self.spec, "finish", None)
        if finish is not None:
            finish()

    def _run_alone(self, job: Job) -> None:
        stream = None
        try:
            if job.cancelled.is_set():
                return
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
            self._finish(job)

    # -- batching ---------------------------------------------------------------------
    def _run_batched(self) -> None:
        batch = self._batch = self.spec.batch(self.max_batch)
        rows: list[tuple[Job, Iterator]] = []
        while True:
            with self._ready:
                while not self._waiting and not rows and not self._closed:
                    self._ready.wait()
                if not self._waiting and not rows:
                    return
                job = self._waiting[0] if self._waiting and len(rows) < self.max_batch else None
            if job is not None and job.plan is None:
                job.plan = self._plan(job)  # off the lock: it may time the model once
            alone = None
            with self._ready:
                if job is not None and self._waiting and self._waiting[0] is job:
                    if job.plan or not rows:  # one that cannot join waits for the rows before it
                        self._waiting.popleft()
                        self._running.append(job)
                        if not job.plan:
                            alone = job
                    job = job if job.plan else None
                else:
                    job = None
            if alone is not None:
                self._run_alone(alone)
                continue
            if job is not None:
                try:
                    if not job.cancelled.is_set():
                        rows.append((job, self.spec.stream_in(batch, prompt=job.prompt, request=job.request,
                                                              plan=job.plan)))
                    else:
                        self._finish(job)
                except Exception as err:  # refused: handed to the request
                    self._send(job, err)
                    self._finish(job)
            for entry in list(rows):
                if not self._advance(*entry):
                    rows.remove(entry)
                    self._finish(entry[0])

    def _plan(self, job: Job):
        """JOB's batch row plan, or False: it runs alone."""
        try:
            return self.spec.batch_plan(job.request)[0] or False
        except Exception:  # the request is wrong: run alone, it fails there with its error
            return False

    def _advance(self, job: Job, stream: Iterator) -> bool:
        """Hand JOB its next chunk; False once it is over (done, failed or cancelled)."""
        try:
            if job.cancelled.is_set():
                stream.close()
                return False
            chunk = next(stream)
            if chunk.tokens or chunk.text:  # not a row's "still prefilling" chunk
                self._send(job, chunk)
            return True
        except StopIteration:
            self._send(job, _DONE)
        except Exception as err:  # handed to the request, which answers with it
            self._send(job, err)
            stream.close()
        return False
