"""The target's cache for several requests at once, each row rolled back by its own amount.

Attention layers: a ``ragged_kv.RaggedKVCache`` per layer. Row i's tokens sit at ``[0,
ends[i])`` as a single request's ``KVCache`` keeps them, its RoPE offset is its own length, and
each row writes at its own end (the mask hides what lies past it). A verify feeds every row the
same width W (its last token, its drafts, pad tokens to W) and row i keeps ``kept[i]`` of those
positions; the other ``W - kept[i]`` at its end are junk, and rolling row i back only moves its
end: no row's history moves (mlx-lm's ``BatchKVCache``, whose rows all end at one index, had
to move each row by its own junk count, a gather of every layer's keys and values a step).

GatedDeltaNet layers (Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids): an ``ArraysCache`` with one
conv and one recurrent state per row. Rows are prefilled alone and joined, so no padding ever
enters the recurrence ahead of a row's tokens; a verify's junk comes after them and is undone
by tape replay (models/gdn_tape.py): each row's state is the state before the verify advanced
by its own kept count, rows with the same count replayed together.

Other cache kinds (sliding-window rings) do not batch: ``batch_refusal`` says why.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from ..models.gdn_tape import RowCounts, tape_layers
from ..models.layer_capture import LayerCapture, capturing
from ..models.trunk import split_trunk
from . import compiled_forward
from .cache import Snapshot, cache_leaves, snapshot_caches
from .compiled_forward import CompiledForward, eligible
from .ragged_kv import RaggedKVCache


def batch_refusal(model: nn.Module) -> str | None:
    """Why MODEL's requests cannot share a batched forward; None: they can."""
    cache = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in cache_leaves(cache) if type(c) not in (KVCache, ArraysCache)})
    if kinds:
        return (f"its cache has layers of kind {', '.join(kinds)} (batching rolls back KV caches and "
                "GatedDeltaNet states)")
    if len(cache_leaves(cache)) != len(cache):
        return "its cache nests caches per layer"
    if any(type(c) is ArraysCache for c in cache) and tape_layers(model, cache) is None:
        return "it has recurrent layers mlxspec cannot replay"
    return None


def kv_bytes_per_token(model: nn.Module) -> int:
    """Bytes one token takes in MODEL's KV caches (one token fed, the allocation divided out)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]], mx.uint32), cache=cache))
    total = 0
    for c in cache_leaves(cache):
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is not None and values is not None:
            total += (keys.nbytes + values.nbytes) // keys.shape[2]
    return total


class RaggedCache:
    """Per layer a ``RaggedKVCache`` or a batched ``ArraysCache``; rows join (their own
    prefilled caches), leave, and roll back by their own amounts."""

    def __init__(self, model: nn.Module, compiled: bool | None = None):
        self.model = model
        # COMPILED: the rows' logits (and hidden rows) from one compiled graph a shape, over
        # attention-only and GatedDeltaNet hybrid targets (compiled_forward.py). None: on unless
        # ``MLXSPEC_COMPILED_BATCH=0``. A 4-row step is host-bound on CUDA: on an H100, 4 echo
        # requests went from 2.50x to 3.09x stock mlx-lm's batching (docs/benchmarks.md). A fresh
        # CUDA machine compiles the graphs' fused kernels once (minutes). Not compiled: mlx-lm's
        # forward, built op by op.
        compiled = compiled_forward.batch_forward if compiled is None else compiled
        self.compiled = CompiledForward.of(model) if compiled else None
        self.layers: list | None = None
        self._gdn = None  # the taped GatedDeltaNet layers, in the order of the recurrent caches
        self._recurrent: list[ArraysCache] = []
        self._before: list[list] | None = None  # the recurrent caches' arrays before the forward
        self._tapes: list | None = None
        self._trunk = None  # body and head apart, for drafters that read hidden states

    @property
    def recurrent(self) -> bool:
        """Whether some layer is recurrent (GatedDeltaNet): its tape covers one forward."""
        return bool(self._recurrent)

    @property
    def rows(self) -> int:
        if self.layers is None:
            return 0
        if any(isinstance(c, KVCache) for c in self.layers):
            return 1
        kv = next((c for c in self.layers if isinstance(c, RaggedKVCache)), None)
        return len(kv.ends) if kv is not None else self.layers[0].batch_size

    def join(self, row_cache: list) -> None:
        """Append a row: ROW_CACHE is one request's prefilled per-layer cache (B = 1). A row
        alone keeps its own KV caches, so it runs the single-request loop's very forward (no
        padding mask, every verify kernel); a second row turns them into batch caches."""
        if self.layers is None:
            self.layers = [c if isinstance(c, KVCache) else _arrays_row(c) for c in row_cache]
            self._recurrent = [c for c in self.layers if isinstance(c, ArraysCache)]
            if self._recurrent and self._gdn is None:
                self._gdn = tape_layers(self.model, self.layers)
            return
        self.layers = [RaggedKVCache.of_rows([c]) if isinstance(c, KVCache) else c for c in self.layers]
        new = [RaggedKVCache.of_rows([c]) if isinstance(c, KVCache) else _arrays_row(c) for c in row_cache]
        for layer, row in zip(self.layers, new, strict=True):
            layer.extend(row)
        self._share_offset()

    def keep(self, rows: list[int]) -> None:
        """Keep only ROWS (indices, in their new order); the rest leave. One row left gets its
        own KV caches back (see :meth:`join`)."""
        if not rows:
            self.layers, self._recurrent = None, []
            return
        if self.rows == 1:
            return
        index = mx.array(rows, mx.int32)
        for layer in self.layers:
            layer.filter(index)
        if len(rows) == 1:
            self.layers = [c.extract(0) if isinstance(c, RaggedKVCache) else c for c in self.layers]
        else:
            self._share_offset()

    def _share_offset(self) -> None:
        """One offset array for every attention layer (they hold the same rows at the same ends),
        as a rollback leaves them: the next forward builds its write positions once, not once a
        layer (ragged_kv._positions)."""
        kv = [c for c in self.layers if isinstance(c, RaggedKVCache)]
        for c in kv[1:]:
            assert c.ends == kv[0].ends, (c.ends, kv[0].ends)
            c.offset = kv[0].offset

    def forward(self, inputs: mx.array, hidden: bool = False,
                capture: LayerCapture | None = None) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """The model on INPUTS (B, W) over these caches: logits (B, W, V), with HIDDEN the
        final-norm hidden states (B, W, H), with CAPTURE its layers' outputs (B, W, layers x H,
        what DFlash reads); the recurrent layers taped so :meth:`rollback` can undo any tail
        of each row."""
        taping = inputs.shape[1] > 1  # a one-token step is never rolled back
        self._before = [list(c.cache) for c in self._recurrent] if taping else []
        for c in self._recurrent if taping else ():
            c.record_tape = True
        h = None
        if capture is not None:
            capture.attach()
        try:
            if hidden and self._trunk is None:
                self._trunk = split_trunk(self.model)
            if self._compiles_row(inputs, capture):  # a row alone verifies as a single request does
                rows, kept = CompiledForward.of(self.model).row(inputs[0], self.layers, self._trunk if hidden else None)
                logits, h = rows[None], None if kept is None else kept[None]
            elif (self.compiled is not None and eligible(self.layers, inputs, taped=self._gdn is not None)
                  and not capturing(self.model)):
                logits, h = self.compiled(inputs, self.layers, self._trunk if hidden else None)
            elif hidden:
                h = self._trunk.body(inputs, cache=self.layers)
                logits = self._trunk.head(h)
            else:
                logits = self.model(inputs, cache=self.layers)
        finally:
            self._tapes = [getattr(c, "tape", None) for c in self._recurrent]
            for c in self._recurrent:
                c.record_tape, c.tape = False, None
        return logits, h, None if capture is None else capture.take(batched=True)

    def _compiles_row(self, inputs: mx.array, capture: LayerCapture | None) -> bool:
        B, W = inputs.shape
        return (B == 1 and compiled_forward.compiles_width(W)  # as a single request's step
                and capture is None and compiled_forward.compiles_rows(self.layers)
                and self.layers[0].keys is not None and not capturing(self.model))

    def rollback(self, junk: list[int]) -> None:
        """Drop the last ``junk[i]`` positions of row i (its rejected drafts and pad tokens) of
        the last :meth:`forward`."""
        assert len(junk) == self.rows, (len(junk), self.rows)
        kv = [c for c in self.layers if isinstance(c, (RaggedKVCache, KVCache))]  # KVCache: a row alone
        if kv and isinstance(kv[0], KVCache):
            for layer in kv:
                layer.trim(junk[0])
        elif kv:  # every layer holds the same rows at the same ends: one offset array for all
            offset = mx.array([e - j for e, j in zip(kv[0].ends, junk)], mx.int32)
            for layer in kv:
                layer.retreat(junk, offset)
        if self._recurrent and any(junk):
            self._replay(junk)

    def _replay(self, junk: list[int]) -> None:
        width = self._tapes[0].q.shape[1]
        counts = RowCounts([width - j for j in junk])  # the mask and positions every layer shares
        for gdn, c, before, tape in zip(self._gdn, self._recurrent, self._before, self._tapes):
            state0 = before[1] if before[1] is not None else mx.zeros_like(c.cache[1])
            c.cache = list(gdn.replay_rows(tape, state0, counts))

    def length(self, row: int) -> int:
        """Tokens row ROW holds."""
        layer = next(c for c in self.layers if isinstance(c, (RaggedKVCache, KVCache)))
        return layer.offset if isinstance(layer, KVCache) else layer.ends[row]

    def snapshot(self, row: int) -> Snapshot | None:
        """Row ROW's cache alone, as a single request's (for the prefix cache)."""
        layers = self.layers if self.rows == 1 else [layer.extract(row) for layer in self.layers]
        return snapshot_caches(layers, self.length(row))


def _arrays_row(c: ArraysCache) -> ArraysCache:
    """A prefilled recurrent cache as a batch of one (no padding: its mask stays None)."""
    row = ArraysCache(len(c.cache))
    row.cache = list(c.cache)
    return row
