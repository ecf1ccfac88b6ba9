"""Every rank of a sharded target decides the same: checked, seeded alike, stopped together.

Under ``mlx.launch`` each process runs the whole speculative loop (drafter, acceptance,
stopping) on logits its shard's collectives made identical on every rank; nothing but the
model's own collectives is exchanged. That holds only while every rank commits the same
tokens: one that differs (another seed, another draft, a bug) would feed its shard other
tokens and the collectives would mix two generations into silent garbage, or wait forever
on a forward of another length (the ring backend hangs on an all_sum of two sizes). So after
every step, before the next forward, the ranks exchange a running hash of the tokens they
committed and whether their consumer wants more (one all_gather of two numbers each): a hash
that differs is an error on every rank, and a consumer that stopped (a client gone, a stop
string: the generator closed at its yield) stops every rank at that same step. A peer that is
gone is an error too; one that hangs is the watchdog's (engine/watchdog.py). (A step the
engine queued ahead was already dispatched on every rank alike: it completes everywhere.)

The same module carries a serve job from rank 0 to the others (:func:`share`): bytes as a
uint8 array summed with zeros, the only traffic mlxspec adds.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any, Iterator, Sequence

import mlx.core as mx

from ..errors import RankError
from ..models.sharding import lost_peer, nccl_run
from . import watchdog

# The most a rank waits in the per-step exchange: the ranks reach it within their host-side
# skew of each other (they finished the same forward, whose collectives paired them, and rank
# 0's consumer takes its chunk in between: printing, a server's queue), so seconds at most.
# After a peer died, the ring backend has been seen to fail its pending tasks and then leave
# the next exchange waiting for ever (prompt lookup's queued verify on a loaded 2-core machine:
# 7 runs in 18); the watchdog ends that wait after this, not after the 300 s a step may take.
EXCHANGE_LIMIT_S = 30.0


def same_seed(seed: int | None, group) -> int:
    """SEED, or when None a random one drawn by rank 0 and handed to every rank: an unseeded
    request would draw its first key per process, and the ranks would sample other tokens."""
    if seed is not None:
        return seed
    import random

    mine = random.getrandbits(31) if group.rank() == 0 else 0
    with watchdog.watching(), _one_line():
        return int(_all_sum(mx.array(mine, mx.int64), group).item())


def agreed(request: Any, group) -> Any:
    """REQUEST (a GenerationRequest) as every rank runs it: one seed for all, and every
    prefill chunk counted as a step by the watchdog (a long prompt is not a hung peer)."""
    told = request.on_prefill

    def on_prefill(done: int, total: int) -> None:
        watchdog.progress()
        if told is not None:
            told(done, total)

    return replace(request, seed=same_seed(request.seed, group), on_prefill=on_prefill)


def checked(steps: Iterator, group) -> Iterator:
    """The decoder's (tokens, stats) STEPS, passed through; after each one the ranks compare the
    tokens committed so far and agree whether to go on. RankError on a difference or a lost
    peer. Closed at a yield (its consumer stopped), it tells every rank to stop there; told
    by another rank, it ends as if the generation had. Closes STEPS when it ends. The watchdog
    watches each step and each exchange, not the consumer's time at the yield."""
    digest, closing, steps = 0, False, iter(steps)
    try:
        while True:
            with watchdog.watching(), _one_line():
                try:
                    tokens, stats = next(steps)
                except StopIteration:
                    return
            digest = zlib.crc32(_token_bytes(tokens), digest)
            try:
                yield tokens, stats
            except GeneratorExit:
                closing = True
                _closing(digest, group)
                raise
            with watchdog.watching(EXCHANGE_LIMIT_S):
                if not _exchange(digest, True, group):
                    return  # another rank's consumer stopped at this step
    finally:
        _close(steps, quietly=closing)


def share(data: bytes | None, group) -> bytes:
    """Rank 0's DATA on every rank (the others pass None): its length, then its bytes, each
    summed with zeros from the others (on :func:`collective_stream`)."""
    mine = data if group.rank() == 0 else b""
    with _one_line():
        n = int(_all_sum(mx.array(len(mine or b""), mx.int64), group).item())
        if n == 0:
            return b""
        own = mx.array(memoryview(mine)) if mine else mx.zeros((n,), mx.uint8)
        got = _all_sum(own.astype(mx.uint8), group)
        return bytes(memoryview(got.astype(mx.uint8)))


def gathered(values: Sequence[int], group) -> list[list[int]]:
    """Every rank's VALUES (as many on each), by rank."""
    with _one_line():
        values = mx.array([list(values)], mx.int64)
        return mx.distributed.all_gather(values, group=group, stream=collective_stream()).tolist()


def _closing(digest: int, group) -> None:
    # the consumer stopped: the others wait for this step's word. A peer lost now is reported
    # by the next collective; a difference, by the others (they raise), not by a closing generator
    try:
        with watchdog.watching(EXCHANGE_LIMIT_S):
            _exchange(digest, False, group)
    except (RankError, RuntimeError):
        pass


def _close(steps: Iterator, quietly: bool) -> None:
    """Close the decoder's STEPS (it stores its caches); QUIETLY: its errors are dropped (this
    generator is being closed, maybe by the garbage collector, which could only print them)."""
    close = getattr(steps, "close", None)
    if close is None:
        return
    try:
        with watchdog.watching(), _one_line():
            close()
    except (RankError, RuntimeError):
        if not quietly:
            raise


def _token_bytes(tokens) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens)


def _exchange(digest: int, go: bool, group) -> bool:
    """Compare DIGEST across the ranks (RankError on a difference); whether every rank goes on."""
    rows = gathered([digest, int(go)], group)
    digests = [row[0] for row in rows]
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RankError(f"the processes of the sharded run committed different tokens (ranks {odd} differ "
                        "from rank 0: other seeds, drafts or arithmetic); stopping rather than mixing generations")
    return all(row[1] for row in rows)


class _one_line:
    """A backend's error for a peer that is gone, as the one-line RankError."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if isinstance(err, RuntimeError):
            gone = lost_peer(err)
            if gone is not err:
                raise gone from err
        return False


def _all_sum(x: mx.array, group) -> mx.array:
    return mx.distributed.all_sum(x, group=group, stream=collective_stream())


def collective_stream():
    """The stream of the engine's own collectives: the CPU's (a scalar's round trip waits for
    no GPU work queued behind a forward), except over NCCL, whose collectives run on a GPU
    stream (on the CPU stream they fail: "There is no Stream(gpu, N) in current thread")."""
    return None if nccl_run() else mx.cpu
