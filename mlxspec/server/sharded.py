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

Before each job the ranks compare their prefix caches (entries, bytes, budget): caches that
differ (shards of different sizes evict differently) would prefill different lengths and
hang a collective, so they are emptied on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from typing import Iterator

from ..engine.ranks import gathered, share
from ..engine.watchdog import watching
from ..errors import MlxspecError
from ..models.sharding import PeerLost

STOP = b""  # the job that ends the followers


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

    def finish(self) -> None:
        """Tell the followers to stop (the server is done)."""
        try:
            with watching():
                share(STOP, self.group)
        except PeerLost:
            pass  # nobody left to tell


def gone(err: PeerLost) -> None:
    """A process of the run is gone: the sharded model cannot serve again. One line, exit 1."""
    sys.stderr.write(f"error: {err}\n")
    sys.stderr.flush()
    os._exit(1)


def follow(spec, group) -> None:
    """A follower's loop: each job rank 0 sends, run as rank 0 runs it, until the stop job.
    Waiting for a job is not watched (a server may idle for days); running one is."""
    while True:
        data = share(None, group)
        if data == STOP:
            return
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
