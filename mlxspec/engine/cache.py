"""A model plus its cache, forwarded in segments and rolled back exactly.

mlx-lm's caches come in three kinds as far as rollback goes:
- attention KV caches (``KVCache`` ...): trimming the offset is exact;
- ``RotatingKVCache`` (sliding window): trimmable until the ring wraps; after a multi-token
  update the buffer is in temporal order, so dropping its tail is exact too;
- ``ArraysCache`` (GatedDeltaNet / SSM conv + recurrent state): cannot be trimmed. Its arrays
  are replaced, never mutated, by a forward, so a snapshot is a list of references: restore
  it and re-forward the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from ..compat import ring_index, set_ring_index
from ..errors import DrafterError
from ..models.gdn_tape import tape_layers
from ..models.layer_capture import LayerCapture
from ..models.trunk import split_trunk
from . import compiled_forward


def cache_leaves(cache) -> list:
    out = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(cache_leaves(c.caches))
        else:
            out.append(c)
    return out


class RollbackImpossible(RuntimeError):
    """A wrapped sliding-window ring overwritten by 1-token updates cannot be rewound."""


def _trim_rotating(c: RotatingKVCache, n: int) -> None:
    if n <= 0:
        return
    if c.is_trimmable():
        c.trim(n)
        return
    # A wrapped ring that was just written by a multi-token update is in temporal order.
    idx = ring_index(c)
    if idx != c.keys.shape[2] or n >= idx:
        raise RollbackImpossible("a wrapped RotatingKVCache was overwritten in place")
    keep = idx - n
    c.keys = c.keys[..., :keep, :]
    c.values = c.values[..., :keep, :]
    c.offset -= n
    set_ring_index(c, keep)


@dataclass
class _Segment:
    start: int  # cache length before this forward
    tokens: mx.array  # what was fed
    arrays: list | None  # ArraysCache contents before this forward
    rings: dict | None  # rotating caches a 1-token write may overwrite: index -> saved state
    tapes: list | None = None  # GatedDeltaNet recurrence inputs of this forward (replayable)

    @property
    def end(self) -> int:
        return self.start + self.tokens.shape[0]


@dataclass
class Snapshot:
    """A cache's contents over its first ``length`` tokens, kept so a later request that
    starts with the same tokens skips their prefill.

    The arrays are new array objects sharing the cache's buffers: a later in-place write to
    the live cache makes MLX copy the buffer instead (it is still referenced), so a snapshot
    never changes. Attention-only snapshots (``trimmable``) serve any shorter prefix too;
    one holding recurrent state serves exactly ``length`` tokens."""

    length: int
    leaves: list  # per cache leaf: ("kv", k, v) | ("ring", k, v, offset, idx) | ("arrays", [..])
    trimmable: bool

    def arrays(self) -> list[mx.array]:
        return [a for leaf in self.leaves for a in (leaf[1] if leaf[0] == "arrays" else leaf[1:3])
                if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def merged_caches(rows: list[list[KVCache]]) -> list[BatchKVCache]:
    """Several requests' caches (each a list of per-layer KV caches) as one batch, layer by
    layer: a copy, left-padded (mlx-lm's ``BatchKVCache``: each row keeps its own length and
    RoPE offset, its padding masked). A batch's drafters draft their rows together on it."""
    return [BatchKVCache.merge(list(layer)) for layer in zip(*rows, strict=True)]


def snapshot_caches(caches: list, length: int) -> Snapshot | None:
    """The contents of CACHES (all holding ``length`` tokens); None for cache kinds it does
    not know how to copy (they are simply never cached)."""
    leaves, trimmable = [], True
    for c in cache_leaves(caches):
        if isinstance(c, ArraysCache):
            leaves.append(("arrays", list(c.cache)))
            trimmable = False
        elif isinstance(c, RotatingKVCache):
            leaves.append(("ring", *_save_ring(c)))
            trimmable = trimmable and c.offset < c.max_size  # not wrapped: in temporal order
        elif type(c) is KVCache:
            k, v = (None, None) if c.keys is None else (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
            leaves.append(("kv", k, v))
        else:
            return None
    snap = Snapshot(length, leaves, trimmable)
    mx.eval(snap.arrays())
    return snap


def restore_caches(caches: list, snap: Snapshot, length: int) -> None:
    """Load SNAP's first ``length`` tokens into fresh CACHES of the same model."""
    if length != snap.length and not (snap.trimmable and length < snap.length):
        raise ValueError(f"a {snap.length}-token snapshot cannot serve {length} tokens")
    for c, leaf in zip(cache_leaves(caches), snap.leaves, strict=True):
        kind = leaf[0]
        if kind == "arrays":
            c.cache = list(leaf[1])  # forwards replace these arrays, never write into them
        elif leaf[1] is None:
            continue
        elif kind == "kv":  # new array objects: writes go to them, never to the snapshot's
            c.keys, c.values, c.offset = leaf[1][..., :length, :], leaf[2][..., :length, :], length
        else:
            _load_ring(c, (leaf[1][...], leaf[2][...], leaf[3], leaf[4]))
            c.trim(leaf[3] - length)


def _save_ring(c: RotatingKVCache) -> tuple:
    # Views keep the old contents: MLX copies on write when a buffer is still referenced.
    if c.keys is None:
        return None, None, c.offset, ring_index(c)
    return c.keys[...], c.values[...], c.offset, ring_index(c)


def _load_ring(c: RotatingKVCache, saved: tuple) -> None:
    c.keys, c.values, c.offset, index = saved
    set_ring_index(c, index)


class ModelState:
    """A model with its cache; ``length`` tokens are in the cache."""

    def __init__(self, model: nn.Module, keep_hidden: bool = False, capture: tuple[int, ...] | None = None):
        self.model = model
        self.cache = make_prompt_cache(model)
        # An MTP drafter needs the trunk's final-norm hidden states: run body and lm_head apart
        # (the same ops the model's own __call__ runs) and keep the hidden of the last forward.
        # A DFlash drafter needs the outputs of layers CAPTURE instead: ``hidden`` holds them.
        self._capture = LayerCapture(model, capture) if capture else None
        self._trunk = split_trunk(model) if keep_hidden and self._capture is None else None
        self.hidden: mx.array | None = None
        leaves = cache_leaves(self.cache)
        self._arrays = [c for c in leaves if isinstance(c, ArraysCache)]
        self._rotating = [c for c in leaves if isinstance(c, RotatingKVCache)]
        self._trimmable = [
            c for c in leaves if not isinstance(c, (ArraysCache, RotatingKVCache))
        ]
        unsupported = [
            type(c).__name__
            for c in self._trimmable
            if not (isinstance(c, KVCache) or (hasattr(c, "trim") and c.is_trimmable()))
        ]
        self.rollback_error = (
            f"cannot roll back cache type(s) {sorted(set(unsupported))}" if unsupported else None
        )
        # Qwen3.5-style GatedDeltaNet layers record their recurrence inputs during a verify, so
        # a partial accept replays m recurrence steps instead of re-running the model.
        self._taped = tape_layers(model, self.cache) if self._arrays else None
        # Verifies of an attention-only target or a taped GatedDeltaNet hybrid run as one
        # compiled graph a (width, capacity): on CUDA a verify's host time is most of its cost
        # (compiled_forward.py). Layer hooks (a DFlash drafter's capture) run only while a graph
        # is traced, so the graph gives the captured outputs back as outputs of its own.
        compiles = compiled_forward.compiles_rows(self.cache, self._taped)
        self._compiled = compiled_forward.CompiledForward.of(model) if compiles else None
        for c in self._trimmable if compiles else ():
            c.step = compiled_forward.ROW_STEP  # fewer capacities, fewer graphs traced
        self.length = 0
        self._segments: list[_Segment] = []

    @property
    def recurrent(self) -> bool:
        """Whether the model has recurrent (GatedDeltaNet / SSM) layers."""
        return bool(self._arrays)

    def close(self) -> None:
        """The request is over: stop capturing layer outputs."""
        if self._capture is not None:
            self._capture.close()

    def check_rollback(self) -> None:
        if self.rollback_error:
            raise DrafterError(f"speculation is not supported for this model: {self.rollback_error}")

    # -- forward ----------------------------------------------------------
    def prefill(self, tokens: list[int], step: int = 2048) -> mx.array | None:
        """Feed tokens with no logits wanted, in chunks, evaluating the cache as mlx-lm does.

        With ``keep_hidden`` returns their hidden states (n, H)."""
        keep = self._trunk is not None or self._capture is not None
        hidden = []
        for i in range(0, len(tokens), step):
            self.feed(mx.array(tokens[i : i + step], mx.uint32))  # its logits are never evaluated
            if keep:
                hidden.append(self.hidden)
            mx.eval([c.state for c in self.cache], hidden[-1:])
            self.length += min(step, len(tokens) - i)
            mx.clear_cache()
        self._segments.clear()
        if not keep:
            return None
        return mx.concatenate(hidden) if hidden else None

    def pad(self, n: int) -> bool:
        """Append N placeholder positions (zeros) to every attention cache, as if N more tokens
        had been prefilled: a forward then costs what it would at that context, without the
        prefill (costs at a long context are timed so). Recurrent state is left as it is (its
        cost does not grow with the context); a sliding window takes at most its window at a
        time, as a chunked prefill feeds it. False, with nothing changed, where a cache is of
        another kind (a quantized one) or empty (no forward has shown its shape yet)."""
        kv = self._trimmable + self._rotating
        if n <= 0:
            return True
        if any(type(c) not in (KVCache, RotatingKVCache) or c.keys is None for c in kv):
            return False
        for c in kv:
            b, heads, _, dk = c.keys.shape
            dv = c.values.shape[-1]
            chunk = n if type(c) is KVCache else max(1, min(n, c.max_size))
            for done in range(0, n, chunk):
                m = min(chunk, n - done)
                c.update_and_fetch(mx.zeros((b, heads, m, dk), c.keys.dtype),
                                   mx.zeros((b, heads, m, dv), c.values.dtype))
        mx.eval([c.state for c in kv])
        self.length += n
        self._segments.clear()
        return True

    def kv_bytes_per_token(self) -> int:
        """Bytes one more token of context adds to the attention caches (a sliding window's
        none: it stops growing); 0 before a first forward or with no attention cache."""
        return sum((c.keys.shape[1] * c.keys.shape[3] + c.values.shape[1] * c.values.shape[3]) * c.keys.dtype.size
                   for c in self._trimmable if type(c) is KVCache and c.keys is not None)

    def forward(self, tokens: mx.array, rollback: bool = True, whole: bool = False) -> mx.array:
        """Feed ``tokens`` (1-D); returns logits (n, V). With ``rollback`` the feed can be undone;
        ``whole``: it is undone whole or not at all (a queued verify)."""
        if rollback:
            n = tokens.shape[0]
            arrays = [list(c.cache) for c in self._arrays] if self._arrays else None
            # A multi-token write to a ring concatenates (its tail can be cut, as long as one
            # new token stays: the ring keeps max_size - 1 old ones); a 1-token write to a full
            # ring overwrites in place. Keep the ring where a cut could not restore it.
            rings = {
                i: _save_ring(c)
                for i, c in enumerate(self._rotating)
                if (n == 1 or whole) and c.keys is not None and c.offset + n >= c.max_size
            }
            seg = _Segment(self.length, tokens, arrays, rings or None)
            self._segments.append(seg)
        taping = rollback and self._taped is not None and tokens.shape[0] > 1
        for c in self._arrays if taping else ():
            c.record_tape = True
        logits = self._verify(tokens) if self._compiles(tokens.shape[0]) else self.feed(tokens)
        if taping:
            seg.tapes = [c.tape for c in self._arrays]
            for c in self._arrays:
                c.record_tape, c.tape = False, None
        self.length += tokens.shape[0]
        return logits

    @property
    def compiles_verifies(self) -> bool:
        """Whether this state's verifies (2..MAX_ROW_WIDTH tokens) run as compiled graphs (and its
        plain one-token steps, unless ``MLXSPEC_COMPILED_PLAIN=0``)."""
        return self._compiled is not None and compiled_forward.row_verify

    def _compiles(self, n: int) -> bool:
        kv = self._trimmable[0] if self._trimmable else None
        return (self._compiled is not None and compiled_forward.compiles_width(n)
                and kv is not None and kv.keys is not None and all(c[0] is not None for c in self._arrays))

    def _verify(self, tokens: mx.array) -> mx.array:
        """``feed`` of a verify's tokens through the compiled graph: the same logits and hidden rows."""
        logits, hidden = self._compiled.row(tokens, self.cache, self._trunk, self._capture)
        if self._trunk is not None or self._capture is not None:
            self.hidden = hidden
        return logits

    def feed(self, tokens: mx.array) -> mx.array:
        """One model call on ``tokens`` (1-D): logits (n, V), and (``keep_hidden`` / ``capture``)
        their hidden rows in ``hidden``. No rollback record, ``length`` unchanged: for a feed the
        caller accounts for (``forward``; a tree verify, ``engine/tree_forward.py``)."""
        if self._trunk is None:
            if self._capture is not None:
                self._capture.attach()
            logits = self.model(tokens[None], cache=self.cache)[0]
            if self._capture is not None:
                self.hidden, logits = self._capture.take_after(logits)
            return logits
        h = self._trunk.body(tokens[None], cache=self.cache)
        self.hidden = h[0]
        return self._trunk.head(h)[0]

    def snapshot(self) -> Snapshot | None:
        """The cache's contents now (``length`` tokens), or None if they cannot be copied."""
        return snapshot_caches(self.cache, self.length) if self.rollback_error is None else None

    def restore(self, snap: Snapshot, length: int) -> None:
        """Start this (fresh) state from SNAP's first ``length`` tokens."""
        if self.length:
            raise ValueError("restore() needs a fresh ModelState")
        restore_caches(self.cache, snap, length)
        self.length = length

    def commit(self, upto: int | None = None) -> None:
        """Everything fed so far (or up to ``upto`` tokens) is final: drop those rollback
        records. A forward queued past ``upto`` stays undoable."""
        if upto is None:
            self._segments.clear()
        else:
            self._segments = [seg for seg in self._segments if seg.end > upto]

    # -- rollback -----------------------------------------------------------
    def rollback_to(self, length: int) -> None:
        """Make the cache hold exactly its first ``length`` tokens (length >= last commit)."""
        undone = [seg for seg in self._segments if seg.end > length]
        self._segments = [seg for seg in self._segments if seg.end <= length]
        if length >= self.length:
            return
        if not self._arrays and not any(seg.rings for seg in undone):
            self._trim_all(self.length - length)
            return
        if len(undone) == 1 and undone[0].tapes is not None and not undone[0].rings:
            seg = undone[0]
            m = length - seg.start
            for gdn, c, before, tape in zip(self._taped, self._arrays, seg.arrays, seg.tapes):
                c.cache = list(gdn.replay(tape, before[1], m))
            self._trim_all(self.length - length)
            return
        # Restore the state from before the segment holding position `length`, then re-feed
        # the part of that segment that is kept.
        if not undone or undone[0].start > length:
            raise RollbackImpossible(f"no rollback record reaches back to length {length}")
        seg = undone[0]
        for i, c in enumerate(self._rotating):
            saved = next(((s.start, s.rings[i]) for s in undone if s.rings and i in s.rings), None)
            if saved is None:
                _trim_rotating(c, self.length - seg.start)
            else:
                _load_ring(c, saved[1])
                _trim_rotating(c, saved[0] - seg.start)  # it had not wrapped before then
        for c in self._trimmable:
            c.trim(self.length - seg.start)
        for c, snap in zip(self._arrays, seg.arrays or []):
            c.cache = list(snap)
        self.length = seg.start
        if length > seg.start:
            self.forward(seg.tokens[: length - seg.start], rollback=False)

    def _trim_all(self, n: int) -> None:
        for c in self._trimmable:
            c.trim(n)
        for c in self._rotating:
            _trim_rotating(c, n)
        self.length -= n


def model_nbytes(model: nn.Module) -> int:
    """Bytes of parameters: what one forward must stream from memory."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
