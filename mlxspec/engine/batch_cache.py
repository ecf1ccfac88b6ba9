"""The target's cache for several requests at once, each row rolled back by its own amount.

mlx-lm's ``BatchKVCache`` holds rows left-padded to one write index: row i's tokens are at
positions ``[left_padding[i], idx)``, its RoPE offset is ``offset[i]`` (its own length) and
the attention mask hides the padding. A verify feeds every row the same width W (its last
token, its drafts, pad tokens to W) and row i keeps ``kept[i]`` of those positions; the other
``W - kept[i]`` at its end are junk. Rolling row i right by its junk count moves its tokens
to end at ``idx`` again and its junk past ``idx`` (the padding grows by as much), which is
what ``BatchKVCache.finalize`` does for right-padded prompts: the rollback is exact, and the
other rows are untouched.

Only targets whose every layer is a plain ``KVCache`` batch here: a sliding window ring or a
recurrent state (GatedDeltaNet) would need a rollback of its own per row.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .cache import Snapshot, cache_leaves, snapshot_caches


def batch_refusal(model: nn.Module) -> str | None:
    """Why MODEL's requests cannot share a batched forward; None: they can."""
    kinds = sorted({type(c).__name__ for c in cache_leaves(make_prompt_cache(model)) if type(c) is not KVCache})
    if kinds:
        return f"its cache has layers of kind {', '.join(kinds)} (batching rolls back plain KV caches only)"
    return None


def kv_bytes_per_token(model: nn.Module) -> int:
    """Bytes one token takes in MODEL's cache (one token fed, the allocation divided out)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]], mx.uint32), cache=cache))
    total = 0
    for c in cache_leaves(cache):
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is not None and values is not None:
            total += (keys.nbytes + values.nbytes) // keys.shape[2]
    return total


class RaggedCache:
    """Per layer a ``BatchKVCache``; rows join (their own prefilled caches), leave, and roll
    back by their own amounts."""

    def __init__(self):
        self.layers: list[BatchKVCache] | None = None

    @property
    def rows(self) -> int:
        return 0 if self.layers is None else self.layers[0].offset.shape[0]

    def join(self, row_cache: list[KVCache]) -> None:
        """Append a row: ROW_CACHE is one request's prefilled per-layer cache (B = 1)."""
        merged = [BatchKVCache.merge([c]) for c in row_cache]
        if self.layers is None:
            self.layers = merged
            return
        for layer, new in zip(self.layers, merged, strict=True):
            layer.extend(new)

    def keep(self, rows: list[int]) -> None:
        """Keep only ROWS (indices, in their new order); the rest leave."""
        if not rows:
            self.layers = None
            return
        index = mx.array(rows, mx.int32)
        for layer in self.layers:
            layer.filter(index)

    def rollback(self, junk: list[int]) -> None:
        """Drop the last ``junk[i]`` positions of row i (its rejected drafts and pad tokens)."""
        assert len(junk) == self.rows, (len(junk), self.rows)
        common = min(junk)
        if common:
            for layer in self.layers:
                layer.trim(common)
        rest = [j - common for j in junk]
        if any(rest):
            for layer in self.layers:
                layer.prepare(right_padding=rest)
                layer.finalize()

    def length(self, row: int) -> int:
        """Tokens row ROW holds."""
        layer = self.layers[0]
        return layer.size() - int(layer.left_padding[row].item())

    def snapshot(self, row: int) -> Snapshot | None:
        """Row ROW's cache alone, as a single request's (for the prefix cache)."""
        return snapshot_caches([layer.extract(row) for layer in self.layers], self.length(row))

    @property
    def nbytes(self) -> int:
        return 0 if self.layers is None else sum(layer.nbytes for layer in self.layers)
