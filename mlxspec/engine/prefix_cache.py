"""Caches of earlier requests' prompts, so a request that shares a token prefix with one
prefills only what is new (chat turns resend the whole conversation).

Each entry holds the target's cache over some tokens (a :class:`Snapshot`) and, per drafter,
that drafter's own state over them. Attention-only snapshots serve any prefix of their tokens;
a hybrid model's recurrent state exists only where it was taken, so those entries serve exactly
their own tokens (the engine takes them at reusable points: the end of the conversation before
the generation prompt, the end of the prompt, the end of the answer). Entries are kept in
least-recently-used order under a byte budget, and found through sorted indexes of their
tokens (:mod:`.prefix_index`).

The budget counts memory really held: an attention snapshot is a view of the live cache's
buffer, which is allocated in steps (256 tokens) and would stay alive whole behind a short
prompt's view, so an entry keeps compact copies of such views (:func:`compact`) and counts
them, its drafters' state and its tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .cache import Snapshot
from .prefix_index import SortedSequences, encode


@dataclass
class Entry:
    tokens: np.ndarray  # the tokens the snapshots hold, in order: a view of ``seq``
    target: Snapshot
    drafters: dict = field(default_factory=dict)  # drafter name -> its snapshot (opaque)
    drafter_bytes: int = 0
    seq: bytes = b""  # the tokens encoded for the index (prefix_index.encode), counted in nbytes
    used: int = 0  # when it was last stored or served (PrefixCache's clock)

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + self.drafter_bytes + len(self.seq)


def compact(obj):
    """OBJ (a Snapshot, an array, or lists / tuples of them: a drafter's state) holding only
    its own bytes: every array becomes a copy of itself, so a view of part of a larger buffer
    (a KV cache's used slice, a recurrent conv state sliced from its input) lets that buffer go.
    (``x * 1``: a new buffer, the same bits; ``mx.contiguous`` and ``mx.array`` may return a
    view of a buffer that is row-contiguous already.)"""
    if isinstance(obj, Snapshot):
        return Snapshot(obj.length, [compact(leaf) for leaf in obj.leaves], obj.trimmable)
    if isinstance(obj, mx.array):
        return obj * 1
    if isinstance(obj, (list, tuple)):
        return type(obj)(compact(o) for o in obj)
    return obj


def _arrays(obj) -> list:
    if isinstance(obj, Snapshot):
        return obj.arrays()
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for o in obj for a in _arrays(o)]
    return []


def _nbytes(obj) -> int:
    """Bytes of the MLX arrays in a drafter snapshot (nested lists/tuples/Snapshots)."""
    if isinstance(obj, Snapshot):
        return obj.nbytes
    if isinstance(obj, mx.array):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class PrefixCache:
    """Snapshots of recent prompts, most recently used last, at most ``max_bytes`` in all.

    Lookups go through two sorted indexes (:mod:`.prefix_index`), one of the entries that
    serve any prefix of their tokens and one of those that serve exactly their own, so neither
    a lookup nor a store reads every entry."""

    def __init__(self, max_bytes: int):
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # by encoded tokens, LRU first
        self._trimmable: SortedSequences[Entry] = SortedSequences()
        self._exact: SortedSequences[Entry] = SortedSequences()
        self._bytes = 0
        self._uses = 0  # a clock for ties: the entry used last wins
        self._lock = threading.Lock()  # the server's worker and a client thread may both look
        self.hits = self.misses = 0
        self.max_bytes = max_bytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        """A new budget; entries over it are dropped now, least recently used first (0: off)."""
        self._max_bytes = max(0, int(value))
        with self._lock:
            self._evict()

    def _evict(self) -> None:
        while self._entries and self._bytes > self._max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, seq: bytes) -> None:
        entry = self._entries.pop(seq)
        (self._trimmable if entry.target.trimmable else self._exact).remove(seq)
        self._bytes -= entry.nbytes

    def _use(self, entry: Entry) -> None:
        self._uses += 1
        entry.used = self._uses
        self._entries.move_to_end(entry.seq)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._trimmable, self._exact, self._bytes = SortedSequences(), SortedSequences(), 0

    def lookup(self, tokens: list[int], limit: int) -> tuple[Entry, int] | None:
        """The entry serving the longest prefix of TOKENS (at most ``limit`` tokens) and that
        length (of equals, the one used last); None when nothing is reusable. An entry whose
        recurrent state exists only at its own end serves only when it is a prefix whole."""
        want = encode(tokens[:limit])
        with self._lock:
            found = [(e, n) for e, n in self._trimmable.neighbours(want) if n > 0]
            exact = next(self._exact.prefixes_of(want), None)
            if exact is not None:
                found.append((exact, len(exact.tokens)))
            if not found:
                self.misses += 1
                return None
            entry, n = max(found, key=lambda found: (found[1], found[0].used))
            self._use(entry)
            self.hits += 1
        return entry, min(n, entry.target.length)

    def store(self, tokens: list[int], target: Snapshot | None, drafter: str | None = None,
              drafter_state=None) -> None:
        """Keep TARGET (the target's cache over TOKENS) and the drafter's state with it."""
        if target is None or self.max_bytes == 0 or target.length == 0:
            return
        seq = encode(tokens[: target.length])
        target = compact(target)
        if drafter_state is not None:
            drafter_state = compact(drafter_state)
        mx.eval(_arrays(target) + _arrays(drafter_state))  # copy now: the views' buffers can go
        with self._lock:
            old = self._entries.get(seq)
            entry = Entry(np.frombuffer(seq, dtype=">u4"), target, dict(old.drafters) if old else {}, seq=seq)
            if drafter is not None and drafter_state is not None:
                entry.drafters[drafter] = drafter_state
            entry.drafter_bytes = sum(_nbytes(s) for s in entry.drafters.values())
            if old is not None:
                self._drop(seq)
            if entry.nbytes > self.max_bytes:
                return
            if target.trimmable:  # it serves every prefix of its tokens: drop those entries
                for index in (self._trimmable, self._exact):
                    for covered in list(index.prefixes_of(seq)):
                        self._drop(covered.seq)
            self._entries[seq] = entry
            (self._trimmable if target.trimmable else self._exact).add(seq, entry)
            self._bytes += entry.nbytes
            self._use(entry)
            self._evict()

    def stats(self) -> dict:
        return {"entries": len(self), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses}
