"""Caches of earlier requests' prompts, so a request that shares a token prefix with one
prefills only what is new (chat turns resend the whole conversation).

Each entry holds the target's cache over some tokens (a :class:`Snapshot`) and, per drafter,
that drafter's own state over them. Attention-only snapshots serve any prefix of their tokens;
a hybrid model's recurrent state exists only where it was taken, so those entries serve exactly
their own tokens (the engine takes them at reusable points: the end of the conversation before
the generation prompt, the end of the prompt, the end of the answer). Entries are kept in
least-recently-used order under a byte budget.

The budget counts memory really held: an attention snapshot is a view of the live cache's
buffer, which is allocated in steps (256 tokens) and would stay alive whole behind a short
prompt's view, so an entry keeps compact copies of such views (:func:`compact`) and counts
them, its drafters' state and its tokens.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .cache import Snapshot


@dataclass
class Entry:
    tokens: np.ndarray  # the tokens the snapshots hold, in order (counted in nbytes too)
    target: Snapshot
    drafters: dict = field(default_factory=dict)  # drafter name -> its snapshot (opaque)
    drafter_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + self.drafter_bytes + self.tokens.nbytes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


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
    """Snapshots of recent prompts, most recently used last, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int):
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
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
        total = sum(e.nbytes for e in self._entries.values())
        while self._entries and total > self._max_bytes:
            _, evicted = self._entries.popitem(last=False)
            total -= evicted.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def lookup(self, tokens: list[int], limit: int) -> tuple[Entry, int] | None:
        """The entry serving the longest prefix of TOKENS (at most ``limit`` tokens) and that
        length; None when nothing is reusable."""
        want = np.asarray(tokens[:limit], dtype=np.int64)
        best: tuple[Entry, int] | None = None
        with self._lock:
            for key, entry in reversed(self._entries.items()):  # newest first wins ties
                n = common_prefix(entry.tokens, want)
                if not entry.target.trimmable and n < len(entry.tokens):
                    continue  # recurrent state exists only at its own end
                n = min(n, entry.target.length)
                if n > 0 and (best is None or n > best[1]):
                    best = (entry, n, key)
            if best is None:
                self.misses += 1
                return None
            self._entries.move_to_end(best[2])
            self.hits += 1
        return best[0], best[1]

    def store(self, tokens: list[int], target: Snapshot | None, drafter: str | None = None,
              drafter_state=None) -> None:
        """Keep TARGET (the target's cache over TOKENS) and the drafter's state with it."""
        if target is None or self.max_bytes == 0 or target.length == 0:
            return
        arr = np.asarray(tokens[: target.length], dtype=np.int64)
        key = hashlib.blake2b(arr.tobytes(), digest_size=16).digest()  # small: the tokens are kept once
        target = compact(target)
        if drafter_state is not None:
            drafter_state = compact(drafter_state)
        mx.eval(_arrays(target) + _arrays(drafter_state))  # copy now: the views' buffers can go
        with self._lock:
            old = self._entries.pop(key, None)
            entry = Entry(arr, target, dict(old.drafters) if old else {})
            if drafter is not None and drafter_state is not None:
                entry.drafters[drafter] = drafter_state
            entry.drafter_bytes = sum(_nbytes(s) for s in entry.drafters.values())
            if entry.nbytes > self.max_bytes:
                return
            if target.trimmable:  # it serves every prefix of its tokens: drop those entries
                for k in [k for k, e in self._entries.items()
                          if len(e.tokens) <= len(arr) and common_prefix(e.tokens, arr) == len(e.tokens)]:
                    del self._entries[k]
            self._entries[key] = entry
            self._evict()

    def stats(self) -> dict:
        return {"entries": len(self), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses}
