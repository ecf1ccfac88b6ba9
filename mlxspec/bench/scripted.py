"""The scripted target of ``mlxspec bench --real-shapes`` (:class:`ScriptedLogits`), kept apart
from :mod:`.script` so the stock mlx-lm baseline process (:mod:`.stock_worker`) can force the
same script without importing mlxspec's engine, models or kernels: this module imports mlx and
:mod:`mlxspec.compat` only.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..compat import sharding_group, swap_class

HOT = 30.0  # the scripted token's logit over 0 elsewhere: one-hot even at temperature 0.7


def cache_offset(cache) -> int | mx.array:
    """Where the forward on CACHE starts: an int, or inside a compiled graph (one row's cache
    whose end is an array, ``engine/compiled_forward.py``) that (1,) array."""
    for c in cache or ():
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) or (isinstance(offset, mx.array) and offset.size == 1):
            return offset
    return 0


class ScriptedLogits:
    """Replaces ``model``'s logits by a one-hot on ``table[p + 1]`` for the row at position p
    (in a tree verify, a node's position is the cache offset plus its depth: ``current_tree``
    returns the tree being verified, or None; without it no tree is ever seen).

    With ``follow`` set (a (V,) table of successors) the one-hot is on ``follow[x]`` for the row
    whose input token is x, whatever its position: the script of every row of a batch, with no
    row order or cache offsets to know (``script.make_follow_scripts`` builds such tables, where
    each request's continuation is the chain of successors from its prompt's last token).

    The body (tokens -> hidden) notes the positions of its rows from the cache; the lm_head
    call for those rows replaces its output. Other head calls (an MTP head's logits through the
    shared lm_head) keep the real logits."""

    def __init__(self, model: nn.Module, table: list[int], current_tree: Callable | None = None):
        self.table = mx.array(table, mx.int32)
        self.follow: mx.array | None = None
        self.pending: tuple[int, int, list[int] | None, mx.array] | None = None
        lm = getattr(model, "language_model", model)
        # a head mlx-lm's shard() split over the vocabulary computes this rank's slice of it
        group = sharding_group(lm)
        self.rank = group.rank() if group is not None else 0
        body = lm.model
        base = type(body)
        outer = self
        tree_now = current_tree or (lambda: None)

        def call(self_, inputs, cache=None, *args, **kwargs):
            tree = tree_now()  # a tree verify: row i sits at offset + depth(i)
            outer.pending = (cache_offset(cache), inputs.shape[1], None if tree is None else tree.depth, inputs)
            return base.__call__(self_, inputs, cache, *args, **kwargs)

        # a subclass for this one instance: the model's own __call__ reaches it unchanged
        swap_class(body, type(f"Scripted{base.__name__}", (base,), {"__call__": call, "__module__": __name__}))
        if hasattr(lm, "lm_head") and not getattr(lm.args, "tie_word_embeddings", False):
            lm.lm_head = ScriptedHead(lm.lm_head, self)
        else:
            head = ScriptedHead(body.embed_tokens, self, tied=True)
            body.embed_tokens.as_linear = head.__call__

    def replace(self, logits: mx.array) -> mx.array:
        # the trunk's rows come as (1, n, V); an MTP head's through the same lm_head as (n, V)
        if self.pending is None or logits.ndim != 3 or logits.shape[1] != self.pending[1]:
            return logits
        (offset, n, depth, inputs), self.pending = self.pending, None
        ids = mx.arange(logits.shape[-1]) + self.rank * logits.shape[-1]  # this slice's token ids
        if self.follow is not None:  # (B, n) inputs -> (B, n, V)
            hot = ids == self.follow[inputs][..., None]
        else:
            rows = mx.arange(n) if depth is None else mx.array(depth)
            where = mx.minimum(offset + 1 + rows, self.table.shape[0] - 1)
            hot = ids[None] == self.table[where][:, None]
        # the real logits stay a data dependency: their whole lm_head matmul is still computed
        return mx.where(hot, HOT, 0.0).astype(logits.dtype) + logits[..., :1] * 0


class ScriptedHead(nn.Module):
    """The lm_head (or a tied embedding's ``as_linear``) whose output :class:`ScriptedLogits` replaces."""

    def __init__(self, inner: nn.Module, script: ScriptedLogits, tied: bool = False):
        super().__init__()
        self.inner = inner
        self._script = script
        self._call = type(inner).as_linear.__get__(inner) if tied else inner

    def __call__(self, x: mx.array) -> mx.array:
        return self._script.replace(self._call(x))
