"""Verify a draft tree in one target forward, then keep only the accepted path.

``tree_forward(state, tokens, parents)`` feeds the root (the last committed token) and the N
draft nodes as one sequence; node i sits at position ``start + depth(i)`` and sees the cache
prefix, its ancestors and itself (models/tree_attention.py makes the layers do it). Row i of
the logits equals row -1 of a plain forward of the path root..i (the same ops, up to float
summation order).

``keep_path(state, start, path)`` then leaves the cache exactly as if the chain PATH had been
fed with ``state.forward(path_tokens, rollback=False)``: attention caches get the path's rows
moved to slots start.. and the rest cut; GatedDeltaNet caches get the conv rows of the path and
the recurrent state of a chain run along it (recomputed from the pre-tree state: the tree's
per-node states are never kept, which for a large hybrid would be T x the recurrent state per
layer).

Between the two the state is good for ``keep_path`` only: ``length`` counts the T tree rows the
attention caches hold, a GatedDeltaNet cache still holds its pre-tree state, and the tree is
not a rollback record (``rollback_to`` cannot undo it; ``keep_path(state, start, [])`` drops
it whole). After ``keep_path`` the state is a plain one again (``forward``, ``rollback_to`` to
any length an earlier record reaches, ``snapshot``, another tree).

What cannot be tree-verified raises :class:`TreeUnsupported` (a ``RuntimeError``) before the
cache is touched; verify a chain instead:
- a layer other than llama / qwen2 / qwen2_moe / qwen3 / qwen3_moe attention (qwen3_5 and
  qwen3_next's included) with a rope that takes per-token positions, or a Qwen3.5 / Qwen3.6 /
  Qwen3-Next GatedDeltaNet (``compat.tree_attention_classes`` / ``compat.array_offset_ropes``);
- a cache other than ``KVCache``, ``RotatingKVCache`` and a GatedDeltaNet ``ArraysCache``
  (quantized KV caches included), a batched / padded cache;
- a ``RotatingKVCache`` that the tree would fill past its size (``start + T > max_size``: its
  window would start to bite or the ring wrap).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..models.tree_attention import Tree, TreeUnsupported, active, install, make_tree
from .cache import ModelState, cache_leaves

__all__ = ["TreeUnsupported", "keep_path", "tree_forward"]

_READY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> None | why not
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> its fed Tree


def _prepare(state: ModelState) -> None:
    """Make the state's layers tree-aware once; TreeUnsupported (every time) if they cannot be."""
    if state not in _READY:
        try:
            install(state.model, state.cache)
            bad = [type(c).__name__ for c in cache_leaves(state.cache)
                   if type(c) not in (KVCache, RotatingKVCache) and not isinstance(c, ArraysCache)]
            _READY[state] = f"no tree verify over cache type(s) {sorted(set(bad))}" if bad else None
        except TreeUnsupported as e:
            _READY[state] = str(e)
    if _READY[state] is not None:
        raise TreeUnsupported(_READY[state])


def _check_caches(state: ModelState, n: int) -> None:
    for c in cache_leaves(state.cache):
        if isinstance(c, ArraysCache):
            if c.lengths is not None or c.left_padding is not None:
                raise TreeUnsupported("a batched GatedDeltaNet cache")
        elif c.offset != state.length:
            raise TreeUnsupported(f"a cache holds {c.offset} tokens, the state {state.length}")
        elif isinstance(c, RotatingKVCache) and c.offset + n > c.max_size:
            raise TreeUnsupported(
                f"a {n}-token tree at {c.offset} would fill a {c.max_size}-token sliding window")


def tree_forward(state: ModelState, tokens: mx.array, parents: list[int]) -> mx.array:
    """Feed a tree: tokens (N+1,) uint32 = [root, node_1..node_N] where the root is the last
    committed token (not yet in the cache; it goes at position start = state.length) and
    parents[i] (len N+1, parents[0] = -1) is the index (into tokens) of node i's parent; every
    parent comes before its children.

    Node i sits at position start + depth(i) and attends to the whole cache prefix plus its own
    ancestors and itself. Returns logits (N+1, V): row i is the target's next-token distribution
    after the path root..i, as a plain chain forward along that path gives it. With
    ``keep_hidden`` / ``capture``, ``state.hidden`` holds the N+1 rows in input order.

    Call :func:`keep_path` next (see the module docstring). TreeUnsupported (nothing changed):
    verify a chain instead."""
    if state in _PENDING:
        raise RuntimeError("the last tree_forward has not been followed by keep_path")
    n = len(parents)
    if tokens.ndim != 1 or tokens.shape[0] != n:
        raise ValueError(f"{tokens.shape} tokens for a tree of {n} nodes (root included)")
    tree = make_tree(state.length, parents)
    _prepare(state)
    _check_caches(state, n)
    try:
        with active(tree):
            logits = state.feed(tokens)
    except BaseException:
        _cut_rows(state, tree.start)  # layers that appended before the failure
        raise
    state.length += n
    _PENDING[state] = tree
    return logits


def _cut_rows(state: ModelState, length: int) -> None:
    for c in cache_leaves(state.cache):
        if not isinstance(c, ArraysCache) and c.offset > length:
            c.trim(c.offset - length)


def _check_path(tree: Tree, path: list[int]) -> None:
    if not path:
        return
    if path[0] != 0:
        raise ValueError("a kept path starts at the root (index 0)")
    for before, node in zip(path, path[1:]):
        if not 0 <= node < tree.size or tree.parents[node] != before:
            raise ValueError(f"node {node} of the path is not a child of {before}")


def _keep_rows(c, start: int, path: list[int], n: int) -> None:
    """Move the rows of PATH (tree slots start + path[j]) to slots start + j; cut the rest."""
    m = len(path)
    if path != list(range(m)):
        src = mx.array([start + p for p in path])
        c.keys[..., start : start + m, :] = mx.take(c.keys, src, axis=2)
        c.values[..., start : start + m, :] = mx.take(c.values, src, axis=2)
    c.trim(n - m)  # a ring the tree did not wrap is in temporal order: a cut is exact


def keep_path(state: ModelState, start: int, path: list[int]) -> None:
    """After tree_forward at cache length START: make the cache hold exactly start + len(path)
    tokens: the nodes of PATH (indices into tokens, path[0] == 0 the root, each the child of the
    one before) in order, at positions start..start+len(path)-1, as if that chain had been fed
    with ``state.forward(path_tokens, rollback=False)``. Everything else of the tree is dropped;
    an empty PATH drops it all (the state is back at START)."""
    tree = _PENDING.get(state)
    if tree is None:
        raise RuntimeError("keep_path without a tree_forward before it")
    if start != tree.start:
        raise ValueError(f"the tree was fed at {tree.start}, not {start}")
    _check_path(tree, path)
    del _PENDING[state]
    for c in cache_leaves(state.cache):
        if not isinstance(c, ArraysCache):
            _keep_rows(c, start, path, tree.size)
    for record in tree.records.values():
        record.keep(tree, path)
    state.length = start + len(path)
