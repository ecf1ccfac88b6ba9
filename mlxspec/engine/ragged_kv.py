"""One attention layer's keys and values for a batch whose rows end at different places.

mlx-lm's ``BatchKVCache`` keeps every row ending at one write index (rows left-padded), so a
verify whose rows keep different numbers of tokens must move each row's whole history right
by its own junk count to line them up again: on an H200 that gather cost 5.8 ms a step for
four rows of the 8B shape at 512 tokens, against a 13.8 ms forward
(``benchmarks/diag_batch_forward.py``). Here row b's tokens sit at ``[0, ends[b])``, where a
single request's ``KVCache`` keeps them, and each row writes its next tokens at its own end:
rolling a row back is only moving its end. What lies past a row's end (its old junk, zeros,
the space of longer rows) is masked.

Terms: ``ends`` (host ints, one a row) and ``offset`` (the same as an int32 array (B,), what
the model's RoPE reads) count each row's tokens; the extent is the longest row's end, the
keys a forward attends over. While every row ends at the same place the layer behaves as one
``KVCache`` does (a slice write, no mask for one token, "causal" for several), so a batch of
rows in step pays nothing for the raggedness.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

STEP = 256  # positions added at a time when a write would overflow (mlx-lm's KVCache.step)


class RaggedKVCache:
    """Keys and values (B, H, capacity, D) of B rows, row b's tokens at [0, ends[b])."""

    def __init__(self, keys: mx.array | None, values: mx.array | None, ends: list[int]):
        assert keys is None or (keys.shape[0] == len(ends) and keys.shape[2] >= max(ends, default=0)), (
            None if keys is None else keys.shape, ends)
        self.keys, self.values = keys, values
        self.ends = list(ends)
        self.offset = mx.array(self.ends, mx.int32)

    # -- building ---------------------------------------------------------------------
    @classmethod
    def of_rows(cls, rows: list[KVCache]) -> RaggedKVCache:
        """Single requests' caches as rows (each row's tokens copied to [0, its length))."""
        ends = [c.offset for c in rows]
        stored = [c for c in rows if c.keys is not None]
        if not stored:
            return cls(None, None, ends)
        k0, v0 = stored[0].keys, stored[0].values
        capacity = _rounded(max(ends))
        keys = [_fit(c.keys, n, capacity, k0) for c, n in zip(rows, ends)]
        values = [_fit(c.values, n, capacity, v0) for c, n in zip(rows, ends)]
        return cls(mx.concatenate(keys), mx.concatenate(values), ends)

    def extend(self, other: RaggedKVCache) -> None:
        """Append OTHER's rows after these."""
        if other.keys is not None or self.keys is not None:
            like = self if self.keys is not None else other
            capacity = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)
            parts = [(c.keys, c.values, c.ends) for c in (self, other)]
            self.keys = mx.concatenate([_fit(k, max(e, default=0), capacity, like.keys, len(e)) for k, _, e in parts])
            self.values = mx.concatenate([_fit(v, max(e, default=0), capacity, like.values, len(e))
                                          for _, v, e in parts])
        self.ends += other.ends
        self.offset = mx.array(self.ends, mx.int32)

    def filter(self, rows: mx.array | list[int]) -> None:
        """Keep only ROWS (indices, in their new order)."""
        index = rows if isinstance(rows, mx.array) else mx.array(rows, mx.int32)
        rows = index.tolist()
        if self.keys is not None:
            self.keys, self.values = self.keys[index], self.values[index]
        self.ends = [self.ends[i] for i in rows]
        self.offset = mx.array(self.ends, mx.int32)

    def extract(self, row: int) -> KVCache:
        """Row ROW alone, as a single request's cache."""
        cache = KVCache()
        n = self.ends[row]
        if self.keys is not None and n:
            cache.keys = mx.contiguous(self.keys[row: row + 1, :, :n])
            cache.values = mx.contiguous(self.values[row: row + 1, :, :n])
        cache.offset = n
        return cache

    # -- what the model calls -----------------------------------------------------------
    @property
    def uniform(self) -> bool:
        """Whether every row ends at the same place (then no row needs a mask of its own)."""
        return min(self.ends) == max(self.ends)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **_) -> mx.array | str | None:
        """The mask of a forward of N tokens a row: query i of row b sees keys [0, ends[b] + i]
        (bool (B, 1, N, extent)), a uniform batch as a ``KVCache`` does."""
        if self.uniform and window_size is None and not return_array:
            return None if N == 1 else "causal"
        return rows_mask(self.offset, N, max(self.ends) + N, window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write KEYS/VALUES (B, H, N, D) at each row's end; return every row's keys and values
        up to the extent (B, H, extent, D)."""
        B, _, N, _ = keys.shape
        assert B == len(self.ends), (B, self.ends)
        extent = max(self.ends) + N
        self._reserve(extent, keys, values)
        at, after = _positions(self.offset, N, self.uniform)
        if at is None:
            e = self.ends[0]
            self.keys[..., e: e + N, :] = keys
            self.values[..., e: e + N, :] = values
        else:
            self.keys = mx.put_along_axis(self.keys, _spread(at, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, _spread(at, values.shape), values, axis=2)
        self.ends = [e + N for e in self.ends]
        self.offset = after
        return self.keys[..., :extent, :], self.values[..., :extent, :]

    def reserve(self, width: int) -> None:
        """Room for WIDTH more positions after the longest row (keys already held)."""
        self._reserve(max(self.ends) + width, self.keys, self.values)

    def advance(self, keys: mx.array, values: mx.array, width: int, offset: mx.array) -> None:
        """Take KEYS/VALUES (B, H, capacity, D) that a compiled forward wrote WIDTH positions
        into at each row's end (``compiled_forward.StaticKV``); OFFSET: the ends after it."""
        assert keys.shape == self.keys.shape, (keys.shape, self.keys.shape)
        self.keys, self.values = keys, values
        self.ends = [e + width for e in self.ends]
        self.offset = offset

    def _reserve(self, extent: int, keys: mx.array, values: mx.array) -> None:
        if self.keys is not None and extent <= self.keys.shape[2]:
            return
        B, H, _, D = keys.shape
        grow = _rounded(extent) - (0 if self.keys is None else self.keys.shape[2])
        new_k = mx.zeros((B, H, grow, D), keys.dtype)
        new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    # -- rolling back -------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last N tokens of every row."""
        return self.retreat([n] * len(self.ends))

    def retreat(self, junk: list[int], offset: mx.array | None = None) -> int:
        """Drop the last ``junk[b]`` tokens of row b: only its end moves. OFFSET: the new ends
        as an array, when the caller built it once for many layers."""
        assert len(junk) == len(self.ends) and all(0 <= j <= e for j, e in zip(junk, self.ends)), (junk, self.ends)
        self.ends = [e - j for e, j in zip(self.ends, junk)]
        self.offset = offset if offset is not None else mx.array(self.ends, mx.int32)
        return max(junk, default=0)

    # -- what mlx-lm's cache helpers read ------------------------------------------------
    @property
    def state(self):
        return self.keys, self.values, self.offset

    def size(self) -> int:
        return max(self.ends, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def rows_mask(offset: mx.array, n: int, length: int, window_size: int | None = None) -> mx.array:
    """Query i of row b (at OFFSET[b] + i) sees keys [0, offset[b] + i] of LENGTH, within
    WINDOW_SIZE of it if given: bool (B, 1, N, LENGTH)."""
    keys = mx.arange(length)[None, None, None, :]
    last = offset[:, None, None, None] + mx.arange(n)[None, None, :, None]  # (B, 1, N, 1)
    mask = keys <= last
    if window_size is not None:
        mask = mask & (keys > last - window_size)
    return mask


def write_positions(offset: mx.array, n: int) -> mx.array:
    """Where rows at OFFSET write their N new positions: (B, 1, N, 1)."""
    return (offset[:, None] + mx.arange(n)[None])[:, None, :, None]


# The last write's positions: every layer of a model holds the same rows at the same ends and,
# once a step has rolled them back together, the same offset array, so the first layer builds
# them and the others reuse them (a forward's graph then has a few small ops for this, not a few
# a layer). RaggedCache keeps one offset array for all its layers (batch_cache.py). With them,
# their broadcasts to the keys' and values' shapes (``_spread``), made as the layers ask.
_last: tuple = (None, 0, False, None, None, {})


def _positions(offset: mx.array, n: int, uniform: bool) -> tuple[mx.array | None, mx.array]:
    """(where each row's N new positions go (B, 1, N, 1), None for a uniform batch's slice
    write; the offsets after them) for rows at OFFSET."""
    global _last
    if _last[0] is offset and _last[1] == n and _last[2] == uniform:
        return _last[3], _last[4]
    at = None if uniform else write_positions(offset, n)
    _last = (offset, n, uniform, at, offset + n, {})
    return at, _last[4]


def _spread(at: mx.array, shape: tuple) -> mx.array:
    """AT (B, 1, N, 1), the last positions :func:`_positions` gave, broadcast to SHAPE (B, H, N,
    D): ``put_along_axis`` would broadcast its indices itself, a node a call; made once per
    positions and shape, for every layer's keys and values."""
    made = _last[5] if _last[3] is at else {}
    if shape not in made:
        made[shape] = mx.broadcast_to(at, shape)
    return made[shape]


def _rounded(n: int) -> int:
    return max(STEP, -(-n // STEP) * STEP)


def _fit(x: mx.array | None, n: int, capacity: int, like: mx.array, rows: int = 1) -> mx.array:
    """X's first N positions (all rows) in a (rows, H, CAPACITY, D) array, zeros after (X None:
    all zeros, shaped as LIKE)."""
    if x is None or n == 0:
        return mx.zeros((rows, like.shape[1], capacity, like.shape[3]), like.dtype)
    x = x[..., :n, :]
    return mx.pad(x, [(0, 0), (0, 0), (0, capacity - n), (0, 0)]) if capacity > n else x
