"""A batch's forward over ragged KV caches as one compiled graph (``mx.compile``), built once a
shape and replayed.

Why: on MLX's CUDA backend a 4-row verify of the 8B shape is bound by the host, not the
device. Its graph has about 1,100 operations; building them in Python cost 5.9 ms and launching
them 5.4 ms a forward, while the device finished 3.6 ms after the launch returned
(docs/benchmarks.md, "Where a 4-row step's time goes"). A compiled graph is traced once and
then replayed from C++, and its chains of elementwise operations become one kernel each.

Measured (H200, 4 rows of the 8B shape): the host's build of a step fell from 5.2 to 2.1 ms and
the step became bound by the device (a sleep on the host of up to 4 ms no longer lengthened
it), but the batch's tok/s did not move (paired ratio 0.996). Since the tensor-core verify
matmul cut a wide verify's device time it paid (H100, 4 echo requests: 3.09x stock mlx-lm's
batching against 2.50x op by op), so ``RaggedCache`` uses it by default
(``MLXSPEC_COMPILED_BATCH=0``, :data:`batch_forward`, turns it off), over GatedDeltaNet hybrids
too (their rows' states and tapes in and out of the graph, as a single request's). In bf16 on
CUDA its logits are not bit for bit the op-by-op forward's (the attention kernel splits the
whole buffer's keys into other chunks); in fp32 on the CPU they are.

A compiled graph must not change with the rows' lengths, so inside it each layer's cache is a
:class:`StaticKV`: every row writes its W new keys and values at its own end by scatter (its
positions from the offsets array, not from host ints) and attends over the whole capacity of the
layer's buffer (a multiple of ``ragged_kv.STEP``) through a mask that hides what lies past the
row's end. The shapes that key a graph are the rows, the width and the capacity; the graphs kept
are bounded (:data:`KEPT`): dropping one frees its trace.

A single request's verify (:meth:`CompiledForward.row`, what ``ModelState.forward`` runs for 1 to
:data:`MAX_ROW_WIDTH` tokens over an attention-only target) is compiled the same way over the
request's own ``KVCache`` buffers, which already hold room past their offset: one row, its end
as a (1,) array. Measured (H100, Qwen3-8B shape, 4-bit, 500 tokens of context, 10 ABAB pairs,
``diag_compiled_forward.py --rows 1``): a waited verify of 2 / 4 / 5 / 9 tokens took 6.7 / 8.9 /
8.2 / 11.2 ms against 9.8 / 13.9 / 11.6 / 13.1 op by op, with the same bf16 logits. A plain
one-token step of such a state goes through the same graph (width 1, no tape), queued ahead as
mlx-lm queues its steps (a waited step: 10.3 ms against 10.9 on the 8B shape, 23.9 against 26.7
on the 27B; ``MLXSPEC_COMPILED_PLAIN=0``, :data:`plain_steps`, leaves it op by op).
``MLXSPEC_COMPILED_VERIFY=0`` (read at import; :data:`row_verify`) turns it off.

A GatedDeltaNet hybrid's verify (Qwen3.5/3.6, Qwen3-Next) is compiled too, its recurrent states
and the tapes a rollback replays going in and out of the graph. Measured (H100, Qwen3.6-27B
shape, 4-bit, 1,024 tokens of context, ``diag_compiled_verify.py``): a waited verify of
2 / 4 tokens took 23.8 / 24.0 ms against 33.9 / 35.5 op by op, and the mtp-like cell went from
1.23x to 1.83x stock mlx-lm. ``MLXSPEC_COMPILED_VERIFY=kv`` keeps it to attention-only targets.

A DFlash drafter's target (a :class:`~mlxspec.models.layer_capture.LayerCapture`) is compiled as
well: the capture is attached while the graph is traced, and the chosen layers' outputs are
outputs of the graph.

Terms: ``offset`` (B,) int32, row b's tokens before this forward (``RaggedKVCache.offset``);
``capacity`` C, positions in each layer's buffer; ``W`` tokens a row in this forward.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import OrderedDict
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from ..models.gdn_tape import Tape
from ..models.layer_capture import LayerCapture
from ..models.sharding import launched
from ..models.trunk import Trunk
from .ragged_kv import RaggedKVCache, rows_mask, write_positions

KEPT = 48  # compiled graphs kept (scope x rows x width x capacity); the least recently used goes first
ROW_ENV = "MLXSPEC_COMPILED_VERIFY"


def verify_modes(value: str | None) -> tuple[bool, bool]:
    """What ``MLXSPEC_COMPILED_VERIFY=VALUE`` asks: (a single request's verifies compiled, a
    GatedDeltaNet hybrid's too). Unset: both; ``0``: neither; ``kv``: attention-only targets
    only; ``hybrid`` (its old opt-in) or anything else: both."""
    value = (value or "1").strip().lower()
    return value != "0", value not in ("0", "kv")


def env_switch(name: str, default: bool) -> bool:
    """Environment variable NAME as an on/off switch: ``0`` off, anything else on, DEFAULT when
    unset or empty."""
    value = os.environ.get(name, "").strip()
    return default if not value else value != "0"


row_verify, hybrid_verify = verify_modes(os.environ.get(ROW_ENV))  # read once, at import
PLAIN_ENV = "MLXSPEC_COMPILED_PLAIN"
# a plain one-token step through the same graph (width 1) where verifies are compiled
plain_steps = env_switch(PLAIN_ENV, True)
BATCH_ENV = "MLXSPEC_COMPILED_BATCH"
# a batch of several rows' forward from a compiled graph (RaggedCache's default; =0 off): on an
# H100, 4 echo requests ran at 3.09x stock mlx-lm's batching against 2.50x op by op
batch_forward = env_switch(BATCH_ENV, True)
MAX_ROW_WIDTH = 17  # the widest single-request verify compiled: 16 drafts and the last token
TAPED_ARRAYS = 6  # a Tape's arrays: conv input, q, k, v, a, b
# Positions a request's KV buffers grow by while its verifies are compiled (mlx-lm's KVCache: 256).
# A graph is traced per (width, capacity), so each growth traces every width again: on a tiny
# model's 1,200-token echo run 33 graphs at 256, 15 at 1024. It wastes at most ROW_STEP - 1
# positions a layer (about 150 MB on Qwen3-8B's shape).
ROW_STEP = 1024


def compiles_width(n: int) -> bool:
    """Whether a single request's forward of N tokens is one a compiled graph runs (switched on,
    a plain step only with :data:`plain_steps`, at most :data:`MAX_ROW_WIDTH`): the width half
    of the choice, the caches' half being :func:`compiles_rows`."""
    return row_verify and (1 if plain_steps else 2) <= n <= MAX_ROW_WIDTH


class Graphs:
    """Compiled graphs by key, the last KEPT of them (the least recently used goes first):
    dropping one frees its trace."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._by_key: OrderedDict[tuple, object] = OrderedDict()
        self.traced = 0  # graphs compiled (each costs a trace in Python)

    def get(self, key: tuple, forward):
        """KEY's graph, FORWARD compiled for it if it has none."""
        graph = self._by_key.pop(key, None)
        if graph is None:
            graph = mx.compile(forward)
            self.traced += 1
            while len(self._by_key) >= self.kept:
                self._by_key.popitem(last=False)
        self._by_key[key] = graph
        return graph

    def clear(self) -> None:
        self._by_key.clear()


class StaticKV:
    """One attention layer's cache inside the compiled graph: keys and values (B, H, C, D),
    written at AT, read whole; what mlx-lm's attention calls on a cache."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, at: mx.array):
        self.keys, self.values, self.offset, self.at = keys, values, offset, at

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **_) -> mx.array:
        """Query i of row b sees keys [0, offset[b] + i]: bool (B, 1, N, C)."""
        return rows_mask(self.offset, N, self.keys.shape[2], window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write KEYS/VALUES (B, H, W, D) at each row's end; every position of every row back."""
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(self.at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(self.at, values.shape), values, axis=2)
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values, self.offset


def eligible(layers: list | None, inputs: mx.array, taped: bool = False) -> bool:
    """Whether a compiled graph can run this forward of a batch of two or more rows: every
    attention layer a ragged KV cache holding keys, of one capacity and one offset array; any
    other layer, where the recurrent layers are TAPED and :data:`hybrid_verify` is on, a
    GatedDeltaNet ``ArraysCache`` holding its rows' states (a hybrid); in a process that runs
    the whole model (not one rank of several, whose forward communicates), as :func:`compiles_rows`."""
    kv = [c for c in layers or () if type(c) is RaggedKVCache]
    if not kv or any(c.keys is None for c in kv) or launched():
        return False
    others = [c for c in layers if type(c) is not RaggedKVCache]
    if others and not (taped and hybrid_verify and all(
            type(c) is ArraysCache and all(a is not None for a in c.cache) for c in others)):
        return False
    first = kv[0]
    return inputs.ndim == 2 and inputs.shape[0] == len(first.ends) and all(c.offset is first.offset for c in kv)


_MADE: weakref.WeakSet = weakref.WeakSet()  # every instance alive, for :func:`traces`


class CompiledForward:
    """MODEL's forward over a batch's ragged caches, compiled once for each (rows, width,
    capacity, input dtype) and kept for the last :data:`KEPT` of them."""

    def __init__(self, model: nn.Module, kept: int = KEPT):
        self.model = model
        self.graphs = Graphs(kept)
        # what the graphs captured besides their inputs is the same within a scope (the bench's
        # scripted logits table: one scope a script), so each scope keeps graphs of its own
        self.scope: object = None
        self.trace_s = 0.0  # host seconds the calls that traced took
        _MADE.add(self)

    @property
    def traced(self) -> int:
        """Graphs compiled (each costs a trace of the model in Python)."""
        return self.graphs.traced

    @classmethod
    def of(cls, model: nn.Module) -> CompiledForward:
        """MODEL's one instance: batches come and go (a bench's repetitions, a server's idle
        spells), its graphs stay. The model holds it (not a parameter: MLX keeps plain objects
        as attributes), so both go together."""
        shared = getattr(model, "_mlxspec_compiled_forward", None)
        if shared is None:
            shared = cls(model)
            setattr(model, "_mlxspec_compiled_forward", shared)
        return shared

    def __call__(self, inputs: mx.array, layers: list,
                 trunk: Trunk | None = None) -> tuple[mx.array, mx.array | None]:
        """Logits (B, W, V) of INPUTS (B, W) over a batch's LAYERS (:func:`eligible`), and with
        TRUNK (a model cut at its final norm: rows whose drafter reads them) the hidden rows
        (B, W, H), else None. Each ``RaggedKVCache``'s ends advance by W (as its
        ``update_and_fetch`` leaves them); each GatedDeltaNet ``ArraysCache`` holds its rows'
        states after the W tokens and, where ``record_tape`` is set, their tape (as
        :meth:`row`)."""
        B, W = inputs.shape
        kv = [c for c in layers if type(c) is RaggedKVCache]
        recurrent = [c for c in layers if type(c) is not RaggedKVCache]
        for c in kv:
            c.reserve(W)
        offset = kv[0].offset
        capacity = kv[0].keys.shape[2]
        assert all(c.keys.shape[2] == capacity for c in kv), [c.keys.shape for c in kv]
        kinds = tuple(0 if type(c) is RaggedKVCache else len(c.cache) for c in layers)  # 0: KV; n: n arrays
        key = (B, W, capacity, inputs.dtype, trunk is not None, kinds)
        logits, hidden, keys, values = self._replay(key, trunk, kinds, None, inputs, offset, kv, recurrent)
        after = offset + W
        for c, k, v in zip(kv, keys, values, strict=True):
            c.advance(k, v, W, after)
        return logits, (hidden[0] if hidden else None)

    def row(self, tokens: mx.array, layers: list, trunk: Trunk | None = None,
            capture: LayerCapture | None = None) -> tuple[mx.array, mx.array | None]:
        """One request's verify: logits (W, V) of TOKENS (W,) over its own caches LAYERS (one a
        layer: ``KVCache``s every one at the same offset, and a hybrid's GatedDeltaNet
        ``ArraysCache``s, taped layers), and with TRUNK (a model cut at its final norm) the hidden
        rows (W, H) too, or with CAPTURE (a DFlash drafter's layers, not pipelined) the captured
        layers' outputs (W, len(ids) * H), as its ``take`` gives them. Each KV layer then holds
        W more tokens, as ``update_and_fetch`` leaves it (the buffer past them keeps whatever it
        held: a trim moves the offset only); each recurrent layer holds its state after the W
        tokens and, where ``record_tape`` is set, the :class:`~mlxspec.models.gdn_tape.Tape` a
        rollback replays."""
        assert trunk is None or capture is None
        W = tokens.shape[0]
        kv = [c for c in layers if type(c) is KVCache]
        recurrent = [c for c in layers if type(c) is not KVCache]
        start = kv[0].offset
        assert all(c.offset == start for c in kv), [c.offset for c in kv]
        for c in kv:
            make_room(c, start + W)
        capacity = kv[0].keys.shape[2]
        assert all(c.keys.shape[2] == capacity for c in kv), [c.keys.shape for c in kv]
        kinds = tuple(0 if type(c) is KVCache else len(c.cache) for c in layers)  # 0: KV; n: n arrays
        ids = None if capture is None else capture.ids
        key = ("row", W, capacity, kv[0].keys.dtype, trunk is not None, kinds, ids)
        # the capture's layers keep their outputs only while the graph is traced, as outputs of it
        logits, hidden, keys, values = self._replay(key, trunk, kinds, capture, tokens[None],
                                                    mx.array([start], mx.int32), kv, recurrent)
        for c, k, v in zip(kv, keys, values, strict=True):
            c.keys, c.values = k, v
            c.offset += W
        return logits[0], (hidden[0][0] if hidden else None)

    def _replay(self, key: tuple, trunk: Trunk | None, kinds: tuple[int, ...], capture: LayerCapture | None,
                inputs: mx.array, offset: mx.array, kv: list, recurrent: list[ArraysCache]) -> tuple:
        """KEY's graph (traced now if it has none: the call's host time goes to ``trace_s``) run
        on INPUTS (B, W) over the KV layers' buffers written at OFFSET and the RECURRENT layers'
        states, which it advances (:func:`_advance_recurrent`): (logits, [hidden] or [], the
        KV layers' new keys, their new values), the KV layers left to the caller."""
        traced, t0 = self.traced, time.perf_counter()
        graph = self.graphs.get((self.scope, *key), partial(self._forward, trunk, kinds, capture))
        logits, hidden, keys, values, states, tapes = graph(
            inputs, offset, [c.keys for c in kv], [c.values for c in kv], [a for c in recurrent for a in c.cache])
        if self.traced > traced:
            self.trace_s += time.perf_counter() - t0
        _advance_recurrent(recurrent, states, tapes, inputs.shape[1])
        return logits, hidden, keys, values

    def _forward(self, trunk: Trunk | None, kinds: tuple[int, ...], capture: LayerCapture | None,
                 inputs: mx.array, offset: mx.array, keys: list[mx.array], values: list[mx.array],
                 states: list[mx.array]) -> tuple:
        """The traced forward of INPUTS (B, W) over caches of KINDS (a layer each: 0 a KV layer,
        written at OFFSET through a :class:`StaticKV`; n a GatedDeltaNet layer's n state arrays,
        taped): (logits, [hidden] with TRUNK, [captured rows] with CAPTURE, else [], keys,
        values, states, tapes)."""
        W = inputs.shape[1]
        at = write_positions(offset, W)
        kv, arrays = iter(zip(keys, values, strict=True)), iter(states)
        layers, recurrent = [], []
        for n in kinds:
            if n == 0:
                layers.append(StaticKV(*next(kv), offset, at))
            else:  # a GatedDeltaNet layer's state, taped as a verify tapes it (a plain step is not)
                c = ArraysCache(n)
                c.cache = [next(arrays) for _ in range(n)]
                c.record_tape = W > 1
                layers.append(c)
                recurrent.append(c)
        if capture is not None:
            capture.attach()
            logits = self.model(inputs, cache=layers)
            hidden = [capture.take(batched=True)]
        elif trunk is None:
            logits, hidden = self.model(inputs, cache=layers), []
        else:
            h = trunk.body(inputs, cache=layers)
            logits, hidden = trunk.head(h), [h]
        statics = [c for c in layers if isinstance(c, StaticKV)]
        tapes = [a for c in recurrent if c.record_tape
                 for a in (c.tape.conv_input, c.tape.q, c.tape.k, c.tape.v, c.tape.a, c.tape.b)]
        return (logits, hidden, [c.keys for c in statics], [c.values for c in statics],
                [a for c in recurrent for a in c.cache], tapes)

    def forget(self) -> None:
        """Drop every graph: what they captured besides their inputs (the weights) changed.
        (What changes with a known tag, such as a bench's script, is better kept apart by
        :attr:`scope`: its graphs are not traced again when it comes back.)"""
        self.graphs.clear()


def _advance_recurrent(recurrent: list[ArraysCache], states: list[mx.array], tapes: list[mx.array], W: int) -> None:
    """What a graph's forward of W tokens did to RECURRENT (GatedDeltaNet caches, in layer
    order): their new STATES, and the TAPES of those that record one (a verify: W > 1)."""
    states, tapes = iter(states), iter(tapes)
    for c in recurrent:
        c.cache = [next(states) for _ in c.cache]
        taped = Tape(*(next(tapes) for _ in range(TAPED_ARRAYS))) if W > 1 else None
        c.advance(W)
        if getattr(c, "record_tape", False):
            c.tape = taped


def compiles_rows(cache: list, taped: list | None = None) -> bool:
    """Whether a single request's verifies over CACHE (one entry a layer) can be compiled: every
    layer mlx-lm's plain ``KVCache`` (no sliding window or quantized cache), or with
    :data:`hybrid_verify` a GatedDeltaNet hybrid whose recurrent layers are all TAPED (one entry
    of ``gdn_tape.tape_layers`` a recurrent cache), in a process that runs the whole model (not
    one rank of several, whose forward communicates)."""
    if not cache or launched():
        return False
    recurrent = [c for c in cache if type(c) is not KVCache]
    if not recurrent:
        return True
    return (hybrid_verify and len(recurrent) < len(cache) and all(type(c) is ArraysCache for c in recurrent)
            and taped is not None and len(taped) == len(recurrent))


def make_room(c: KVCache, extent: int) -> None:
    """Grow C's buffers to hold EXTENT positions, in KVCache's steps, keeping what they hold."""
    held = c.keys.shape[2]
    if extent <= held:
        return
    grow = -(-extent // c.step) * c.step - held
    B, H, _, D = c.keys.shape
    c.keys = mx.concatenate([c.keys, mx.zeros((B, H, grow, D), c.keys.dtype)], axis=2)
    c.values = mx.concatenate([c.values, mx.zeros((B, H, grow, c.values.shape[3]), c.values.dtype)], axis=2)


def traces() -> tuple[int, float]:
    """(graphs traced, host seconds the tracing calls took) over every model's instance."""
    made = list(_MADE)
    return sum(c.traced for c in made), sum(c.trace_s for c in made)
