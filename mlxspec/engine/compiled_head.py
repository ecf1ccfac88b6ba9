"""An MTP head's forward of n pairs over its own KV cache as one compiled graph (``mx.compile``),
traced once a (pairs, cache capacity, layer) and replayed: what the MTP drafter runs to commit a
verify's accepted pairs and to draft each step of its chain.

Why: a head step is one decoder layer, its input projection and norms and the trunk's lm_head,
some fifty operations whose kernels are tiny, so on MLX's CUDA backend its cost is the host's
(1.2 ms a step on the Qwen3-8B shape, about three a verify step, `draft_step_ms` in the bench's
JSON), as a verify's was before it was compiled (``compiled_forward.py``). The graph writes the
head's new keys and values into its ``KVCache`` buffers at the cache's end, passed as a (1,)
array, through a :class:`~.compiled_forward.StaticKV`, exactly as a compiled verify writes the
target's, and returns the head's hidden rows and the logits of the last one (what the chain
samples next; sampling, with its per-request random key, stays outside the graph).

``MLXSPEC_COMPILED_HEAD=1`` (read at import: :data:`enabled`) turns it on. Off by default: it is
exact (bit for bit the op-by-op head in fp32 on the CPU, ``tests/test_compiled_head.py``) but not
yet timed on a GPU.

Terms: ``n`` pairs (h_t, x_{t+1}) in this forward; ``C`` positions in the head layer's buffers;
``i`` the head layer this forward runs (``step % layers``, as the head's module picks it).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..models.mtp.head import MTPHead
from ..models.sharding import launched
from .compiled_forward import KEPT, ROW_STEP, Graphs, StaticKV, env_switch, make_room
from .ragged_kv import write_positions

HEAD_ENV = "MLXSPEC_COMPILED_HEAD"
enabled = env_switch(HEAD_ENV, False)
MAX_PAIRS = 16  # the most pairs one compiled forward takes: a verify's accepted tokens and its last


class CompiledHead:
    """HEAD's forward of n pairs, compiled once for each (n, capacity, dtype, layer) and kept
    for the last :data:`KEPT` of them."""

    def __init__(self, head: MTPHead, kept: int = KEPT):
        self.head = head
        self.graphs = Graphs(kept)

    @classmethod
    def of(cls, head: MTPHead) -> CompiledHead:
        """HEAD's one instance (the head holds it): every request's drafter shares its graphs."""
        shared = getattr(head, "_mlxspec_compiled_head", None)
        if shared is None:
            shared = cls(head)
            head._mlxspec_compiled_head = shared
        return shared

    @staticmethod
    def wanted(cache: list) -> bool:
        """Whether forwards over CACHE (the head's, one entry a layer) are compiled: switched on,
        a whole process (not one rank of several), every layer mlx-lm's plain ``KVCache``."""
        return enabled and all(type(c) is KVCache for c in cache) and not launched()

    @classmethod
    def applies(cls, cache: list, step: int, pairs: int) -> bool:
        """Whether a forward of PAIRS pairs at draft step STEP over CACHE runs compiled: wanted,
        at most :data:`MAX_PAIRS`, the layer's cache already holding keys (a head's first
        entries, its prompt's pairs, go op by op)."""
        return 1 <= pairs <= MAX_PAIRS and cache[step % len(cache)].keys is not None and cls.wanted(cache)

    @classmethod
    def prepare(cls, cache: list) -> None:
        """Where CACHE's forwards are :meth:`wanted` compiled, grow its buffers by
        :data:`~.compiled_forward.ROW_STEP` positions at a time: fewer capacities, fewer graphs
        traced (as a compiled target's cache)."""
        for c in cache if cls.wanted(cache) else ():
            c.step = ROW_STEP

    def __call__(self, tokens: mx.array, hidden: mx.array, cache: list, step: int = 0) -> tuple[mx.array, mx.array]:
        """Pairs (h_t, x_{t+1}): TOKENS (n,), HIDDEN (n, H) over CACHE -> (the head's hidden
        (n, H), the logits (1, V) of its last row). The layer's cache then holds n more
        entries, as ``update_and_fetch`` leaves it."""
        n = tokens.shape[0]
        assert hidden.shape[0] == n, (tokens.shape, hidden.shape)
        i = step % len(cache)
        c = cache[i]
        make_room(c, c.offset + n)
        key = (n, c.keys.shape[2], c.keys.dtype, hidden.dtype, i, len(cache))
        graph = self.graphs.get(key, partial(self._forward, i, len(cache)))
        out, logits, c.keys, c.values = graph(tokens, hidden, mx.array([c.offset], mx.int32), c.keys, c.values)
        c.offset += n
        return out, logits

    def _forward(self, i: int, layers: int, tokens: mx.array, hidden: mx.array, offset: mx.array,
                 keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The traced forward: layer I of LAYERS over a :class:`StaticKV` written at OFFSET."""
        static = StaticKV(keys, values, offset, write_positions(offset, tokens.shape[0]))
        cache = [static if j == i else None for j in range(layers)]
        out = self.head.forward(tokens, hidden, cache, step=i)  # (n, H)
        return out, self.head.logits(out[-1:]), static.keys, static.values


def head_forward(head: MTPHead, tokens: mx.array, hidden: mx.array, cache: list,
                 step: int = 0) -> tuple[mx.array, mx.array]:
    """HEAD over pairs (TOKENS (n,), HIDDEN (n, H)) at draft step STEP over CACHE: (its hidden
    (n, H), the logits (1, V) of the last row), compiled where :meth:`CompiledHead.applies`,
    else op by op."""
    if CompiledHead.applies(cache, step, tokens.shape[0]):
        return CompiledHead.of(head)(tokens, hidden, cache, step)
    out = head.forward(tokens, hidden, cache, step)
    return out, head.logits(out[-1:])
