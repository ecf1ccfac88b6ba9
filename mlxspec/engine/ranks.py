"""Every rank of a sharded target decides the same: checked, and seeded alike.

Under ``mlx.launch`` each process runs the whole speculative loop (drafter, acceptance,
stopping) on logits its shard's collectives made identical on every rank; nothing but the
model's own collectives is exchanged. That holds only while every rank commits the same
tokens: one that differs (another seed, another draft, a bug) would feed its shard other
tokens and the collectives would mix two generations into silent garbage, or wait forever
on a forward of another length (the ring backend hangs on an all_sum of two sizes). So the
committed tokens are compared after every step (a running hash of them, gathered from
every rank: one scalar each), and a difference is an error on every rank; a peer that is gone is
one too. (A step the engine queued ahead was already dispatched: a divergence that changes its
shape can still hang there; mlx.launch's own exit handling then ends the run.)
"""

from __future__ import annotations

import zlib
from typing import Iterator

import mlx.core as mx

from ..errors import RankError
from ..models.sharding import lost_peer

# steps between comparisons: every step, so a divergence stops before a forward of another
# shape can hang; it costs one scalar all_sum and one host read a step, against two all_sums
# per layer in every forward
CHECK_EVERY = 1


def same_seed(seed: int | None, group) -> int:
    """SEED, or when None a random one drawn by rank 0 and handed to every rank: an unseeded
    request would draw its first key per process, and the ranks would sample other tokens."""
    if seed is not None:
        return seed
    import random

    mine = random.getrandbits(31) if group.rank() == 0 else 0
    return int(_all_sum(mx.array(mine, mx.int64), group).item())


def checked(steps: Iterator, group, every: int = CHECK_EVERY) -> Iterator:
    """The decoder's (tokens, stats) STEPS, passed through, with the committed tokens compared
    across GROUP's ranks every EVERY steps and after the last; RankError on a difference or a
    lost peer."""
    digest, since = 0, 0
    try:
        for tokens, stats in steps:
            digest = zlib.crc32(_token_bytes(tokens), digest)
            since += 1
            if since >= every:
                _compare(digest, group)
                since = 0
            yield tokens, stats
        _compare(digest, group)
    except RuntimeError as err:
        gone = lost_peer(err)
        if gone is err:
            raise
        raise gone from err


def _token_bytes(tokens) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens)


def _compare(digest: int, group) -> None:
    # gathered, not summed: every rank sees every digest, so all of them stop, and say which
    digests = mx.distributed.all_gather(mx.array([digest], mx.int64), group=group, stream=mx.cpu).tolist()
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RankError(f"the processes of the sharded run committed different tokens (ranks {odd} differ "
                        "from rank 0: other seeds, drafts or arithmetic); stopping rather than mixing generations")


def _all_sum(x: mx.array, group) -> mx.array:
    # on the CPU stream: a scalar's round trip needs no GPU work queued behind a forward
    return mx.distributed.all_sum(x, group=group, stream=mx.cpu)
