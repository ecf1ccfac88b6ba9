"""``mlxspec serve`` over a target sharded by ``mlx.launch``: rank 0 serves, the others follow.

Rank 0 serves HTTP as a single process does, one request at a time. Its worker runs each
generation through :class:`Leader`, which first hands the job to every other rank: the
prompt's token ids and the GenerationRequest with its callbacks left out (everything that
decides tokens: sampling, seed, drafter, depth, trees, constraint, penalties, logprobs,
reuse), pickled (ranks of one run trust each other) and sent as bytes over the world group
(engine/ranks.py ``share``). Every other rank runs :func:`follow`: it waits for the next
job, runs the very same ``SpecModel.stream`` call and drops its output, so the model's
collectives meet. A stream rank 0 stops early (a client gone, a stop string, shutdown) stops
the followers at the same step (``checked``). When rank 0's server stops it sends an empty job:
the followers return and their processes exit 0.

While rank 0 has no job its worker meets the followers every ``IDLE_TICK_S`` with ``IDLE``,
and they sleep between these meetings: a follower waiting inside a collective for the next
request kept a core busy (the ring backend polls: 60-70 % of a core, and as much again on a
second thread, on the 2-core machine), for as long as the server stayed idle. A request waits
at most one tick for its followers; a follower now notices a rank 0 that died or hangs while
idle too (the lost-peer line, or the watchdog's).

Before each job the ranks compare their prefix caches (entries, bytes, budget): caches that
differ (shards of different sizes evict differently) would prefill different lengths and
hang a collective, so they are emptied on every rank.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import time
from typing import Iterator

from ..engine.ranks import gathered, share
from ..engine.watchdog import exit_now, watching
from ..errors import MlxspecError
from ..models.sharding import PeerLost

STOP = b""  # the job that ends the followers
IDLE = b"idle"  # no job this tick (a job is a pickle: it starts with b"\x80")
IDLE_TICK_S = 0.05  # between the idle meetings: at most this long before a request starts


def job_bytes(prompt: list[int], request) -> bytes:
    """PROMPT (token ids) and REQUEST, its callables (on_prefill, on_status, on_note) left out."""
    plain = {f.name: None for f in dataclasses.fields(request) if callable(getattr(request, f.name))}
    return pickle.dumps((list(prompt), dataclasses.replace(request, **plain)), protocol=pickle.HIGHEST_PROTOCOL)


def same_caches(spec, group) -> bool:
    """Empty every rank's prefix cache unless all hold the same (entries, bytes, budget):
    whether they did."""
    cache = spec.prompt_cache
    rows = gathered([len(cache), cache.nbytes, cache.max_bytes], group)
    if all(row == rows[0] for row in rows):
        return True
    cache.clear()
    return False


class Leader:
    """What rank 0's worker runs: each generation sent to the followers, then run here."""

    def __init__(self, spec, group):
        self.spec, self.group = spec, group

    def stream(self, prompt: list[int], request) -> Iterator:
        try:
            with watching():  # a follower that hangs: rank 0 does not wait for ever
                share(job_bytes(prompt, request), self.group)
                same_caches(self.spec, self.group)
            yield from self.spec.stream(prompt=prompt, request=request)
        except PeerLost as err:
            gone(err)

    idle_tick_s = IDLE_TICK_S

    def idle(self) -> None:
        """No job this tick: meet the followers, who then sleep a tick (not poll in a collective)."""
        try:
            with watching():
                share(IDLE, self.group)
        except PeerLost as err:
            gone(err)

    def finish(self) -> None:
        """Tell the followers to stop (the server is done)."""
        try:
            with watching():
                share(STOP, self.group)
        except PeerLost:
            pass  # nobody left to tell


def gone(err: PeerLost) -> None:
    """A process of the run is gone: the sharded model cannot serve again. One line, exit 1."""
    exit_now(1, f"error: {err}")


def follow(spec, group) -> None:
    """A follower's loop: each job rank 0 sends, run as rank 0 runs it, until the stop job;
    between rank 0's idle meetings it sleeps. Every meeting is watched: rank 0 meets it at least
    every tick."""
    while True:
        with watching():
            data = share(None, group)
        if data == STOP:
            return
        if data == IDLE:
            time.sleep(IDLE_TICK_S)
            continue
        prompt, request = pickle.loads(data)
        with watching():
            same_caches(spec, group)
        try:
            for _ in spec.stream(prompt=prompt, request=request):
                pass
        except PeerLost:
            raise
        except MlxspecError:  # rank 0 met the same and answers its client with it
            continue
        except Exception as err:  # rank 0's copy says what it was; this one, for the follower's log
            detail = " ".join(str(err).split())[:200]
            sys.stderr.write(f"error: a served generation failed: {type(err).__name__}: {detail}\n")
