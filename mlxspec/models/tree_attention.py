"""A draft tree verified by one forward of an mlx-lm model: the model-side half.

A tree of T tokens (the root, then the nodes, every parent before its children) is fed as one
sequence of T rows. While a :class:`Tree` is active on this thread (:func:`active`), the layers
made tree-aware by :func:`install` treat row i as the last token of the path root..i:

- an attention layer's rope puts row i at position ``start + depth(i)`` (``mx.fast.rope`` takes
  an array of offsets, one per batch item: the rows go to the batch axis and back), and its
  attention uses the tree mask: the whole cache prefix, then row i's ancestors and itself;
- a GatedDeltaNet layer (Qwen3.5 / Qwen3.6 / Qwen3-Next) convolves each row over its own
  ancestor window (the layer's conv1d on a batch of windows) and runs mlx-lm's
  ``gated_delta_update`` level by level, each node from its parent's state. It leaves its cache
  as it was and records what :meth:`GdnRecord.keep` needs to install the state after a path.

Outside a tree the swapped-in classes are mlx-lm's layers unchanged (one thread-local read a
call). The engine half (ModelState, KV rows, keeping a path) is ``engine/tree_forward.py``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.gated_delta import normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from ..compat import array_offset_ropes, swap_class, tree_attention_classes
from ..kernels.gdn import gated_delta_update  # mlx-lm's own, or the CUDA kernel there


class TreeUnsupported(RuntimeError):
    """This model or cache cannot verify a tree in one forward: verify a chain instead."""


# -- the tree of one call ------------------------------------------------------------------


def ancestor_matrix(parents: list[int]) -> np.ndarray:
    """(T, T) bool: row i is true at i and at each of its ancestors."""
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def check_parents(parents: list[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError("parents[0] must be -1 (the root)")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i}'s parent {p} does not come before it")


def path_to(parents: list[int], i: int) -> list[int]:
    """The indices root..i."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@dataclass
class Tree:
    """One tree verify: T rows fed at cache length ``start``."""

    start: int
    parents: list[int]
    depth: list[int]
    positions: mx.array  # (T,) int32: start + depth
    mask: mx.array  # (T, start + T) bool: the prefix, then ancestors-or-self
    records: dict = field(default_factory=dict)  # id(ArraysCache) -> GdnRecord
    _windows: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.parents)

    def levels(self) -> list[list[int]]:
        """The nodes by depth, each level in input order."""
        out: list[list[int]] = [[] for _ in range(max(self.depth) + 1)]
        for i, d in enumerate(self.depth):
            out[d].append(i)
        return out

    def windows(self, k: int) -> np.ndarray:
        """(T, k) int32 rows of [k - 1 conv state rows, T tree rows] that a width-k causal conv
        reads for each node: the last k of (state rows, then the path root..node)."""
        if k not in self._windows:
            table = np.zeros((self.size, k), dtype=np.int32)
            for i in range(self.size):
                seq = list(range(k - 1)) + [k - 1 + a for a in path_to(self.parents, i)]
                table[i] = seq[-k:]
            self._windows[k] = table
        return self._windows[k]


def make_tree(start: int, parents: list[int]) -> Tree:
    check_parents(parents)
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        depth[i] = depth[p] + 1
    anc = mx.array(ancestor_matrix(parents))
    mask = mx.concatenate([mx.ones((len(parents), start), dtype=mx.bool_), anc], axis=1)
    positions = mx.array([start + d for d in depth], dtype=mx.int32)
    return Tree(start, list(parents), depth, positions, mask)


_LOCAL = threading.local()


def current() -> Tree | None:
    return getattr(_LOCAL, "tree", None)


@contextmanager
def active(tree: Tree):
    """Make TREE the one the tree-aware layers of this thread follow, for this block only."""
    if current() is not None:
        raise RuntimeError("a tree verify is already running on this thread")
    _LOCAL.tree = tree
    try:
        yield tree
    finally:
        _LOCAL.tree = None


# -- tree-aware layers ---------------------------------------------------------------------


class _TreeRope:
    """A rope module that, inside a tree, ropes row i at ``start + depth(i)``."""

    def __call__(self, x, offset=0, *args, **kwargs):
        tree = current()
        if tree is None:
            return super().__call__(x, offset, *args, **kwargs)
        if x.ndim != 4 or x.shape[0] != 1 or x.shape[2] != tree.size or offset != tree.start:
            raise TreeUnsupported(f"a rope call of shape {x.shape} at offset {offset} inside a tree")
        # (1, H, T, D) -> (T, H, 1, D): one offset per batch item, then back
        y = super().__call__(x.transpose(2, 1, 0, 3), tree.positions, *args, **kwargs)
        return y.transpose(2, 1, 0, 3)


class _TreeAttention:
    """An attention layer that, inside a tree, attends with the tree mask."""

    def __call__(self, x, mask=None, cache=None):
        tree = current()
        if tree is not None:
            if cache is None or cache.offset != tree.start or x.shape[:2] != (1, tree.size):
                raise TreeUnsupported("an attention call inside a tree that is not the tree's")
            mask = tree.mask
        return super().__call__(x, mask, cache)


@dataclass
class GdnRecord:
    """What a GatedDeltaNet layer computed for a tree: enough to install, for any path, the
    state a chain along it leaves (the conv rows of the path, its recurrence from ``state``)."""

    layer: nn.Module
    cache: object  # the layer's ArraysCache, untouched by the tree
    rows: mx.array  # (K - 1 + T, C): the conv state rows, then the tree's pre-conv rows
    q: mx.array  # (1, T, Hk, Dk), normalized
    k: mx.array
    v: mx.array  # (1, T, Hv, Dv)
    a: mx.array  # (1, T, Hv)
    b: mx.array

    def keep(self, tree: Tree, path: list[int]) -> None:
        """Set the cache to its state after the chain PATH (no change for an empty path)."""
        if not path:
            return
        n_keep = self.layer.conv_kernel_size - 1
        last_window = tree.windows(n_keep + 1)[path[-1]]
        self.cache[0] = mx.contiguous(self.rows[mx.array(last_window[1:])][None])
        idx = mx.array(path)
        _, state = gated_delta_update(
            self.q[:, idx], self.k[:, idx], self.v[:, idx], self.a[:, idx], self.b[:, idx],
            self.layer.A_log, self.layer.dt_bias, self.cache[1], None,
            use_kernel=not self.layer.training,
        )
        self.cache[1] = state


def _gdn_project(layer, inputs: mx.array):  # -> (pre-conv qkv, z, a, b), as the layer's own
    B, S, _ = inputs.shape
    if isinstance(layer, Qwen3NextGatedDeltaNet):
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, a, b
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return layer.in_proj_qkv(inputs), z, layer.in_proj_a(inputs), layer.in_proj_b(inputs)


def _gdn_levels(layer, tree: Tree, q, k, v, a, b, state0) -> mx.array:
    """The recurrence over the tree, one batched step per depth: (1, T, Hv, Dv) in input order."""
    outs, order, rows = [], [], {}
    state = None
    for nodes in tree.levels():
        idx = mx.array(nodes)
        if state is None:
            init = state0
        else:
            init = state[mx.array([rows[tree.parents[i]] for i in nodes])]
        out, state = gated_delta_update(
            q[0, idx][:, None], k[0, idx][:, None], v[0, idx][:, None], a[0, idx][:, None],
            b[0, idx][:, None], layer.A_log, layer.dt_bias, init, None, use_kernel=not layer.training,
        )
        rows = {node: r for r, node in enumerate(nodes)}
        outs.append(out[:, 0])
        order.extend(nodes)
    inverse = np.argsort(np.array(order))
    return mx.concatenate(outs)[mx.array(inverse)][None]


def _gdn_tree_call(layer, tree: Tree, inputs: mx.array, mask, cache) -> mx.array:
    if mask is not None or cache is None or inputs.shape[:2] != (1, tree.size) \
            or getattr(layer, "sharding_group", None) is not None or cache.lengths is not None:
        raise TreeUnsupported("a GatedDeltaNet call inside a tree that is not the tree's")
    T = tree.size
    qkv, z, a, b = _gdn_project(layer, inputs)
    n_keep = layer.conv_kernel_size - 1
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((1, n_keep, layer.conv_dim), dtype=inputs.dtype)
    rows = mx.concatenate([conv_state[0], qkv[0]])
    windows = rows[mx.array(tree.windows(n_keep + 1))]  # (T, K, C): each node's own window
    conv_out = nn.silu(layer.conv1d(windows)).reshape(1, T, -1)
    q, k, v = [
        t.reshape(1, T, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    out = _gdn_levels(layer, tree, q, k, v, a, b, cache[1])
    tree.records[id(cache)] = GdnRecord(layer, cache, rows, q, k, v, a, b)
    out = layer.norm(out, z)
    return layer.out_proj(out.reshape(1, T, -1))


class _TreeGdn:
    """A GatedDeltaNet layer that, inside a tree, follows each node's own ancestors."""

    def __call__(self, inputs, mask=None, cache=None):
        tree = current()
        if tree is None:
            return super().__call__(inputs, mask, cache)
        return _gdn_tree_call(self, tree, inputs, mask, cache)


# -- making a model's layers tree-aware -----------------------------------------------------

_CLASSES: dict[tuple[type, type], type] = {}
_PLAIN: dict[type, type] = {}  # tree-aware class -> the class it was made from


def _tree_class(mixin: type, cls: type) -> type:
    """CLS with MIXIN in front; it keeps CLS's ``__module__``, which kernels.attention.install
    reads to find the mlx-lm module whose attention function it reroutes."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _CLASSES:
        made = type(f"Tree{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
        _CLASSES[(mixin, cls)], _PLAIN[made] = made, cls
    return _CLASSES[(mixin, cls)]


def _plain(cls: type) -> type:
    """The class a tree-aware class was made from (CLS itself otherwise)."""
    return _PLAIN.get(cls, cls)


def tree_layers(model: nn.Module, cache: list) -> list[tuple[str, nn.Module, object]]:
    """("attention" | "gdn", layer, its cache entry) for every decoder layer, or TreeUnsupported
    naming the first layer a tree cannot go through. Changes nothing."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != len(cache):
        raise TreeUnsupported(f"cannot pair the layers of a {type(model).__module__} model with its cache")
    out = []
    for n, (layer, c) in enumerate(zip(layers, cache)):
        gdn, attn = getattr(layer, "linear_attn", None), getattr(layer, "self_attn", None)
        if gdn is not None and getattr(layer, "is_linear", attn is None):
            if not isinstance(gdn, (GatedDeltaNet, Qwen3NextGatedDeltaNet)) or not hasattr(c, "cache"):
                raise TreeUnsupported(f"layer {n}: no tree verify for {type(gdn).__name__}")
            out.append(("gdn", gdn, c))
        elif attn is not None:
            if _plain(type(attn)) not in tree_attention_classes():
                raise TreeUnsupported(f"layer {n}: no tree verify for {type(attn).__name__}")
            rope = getattr(attn, "rope", None)
            if _plain(type(rope)) not in array_offset_ropes():
                raise TreeUnsupported(f"layer {n}: no per-token positions for {type(rope).__name__}")
            out.append(("attention", attn, c))
        else:
            raise TreeUnsupported(f"layer {n}: no attention found in {type(layer).__name__}")
    return out


def install(model: nn.Module, cache: list) -> list[tuple[str, nn.Module, object]]:
    """Make every layer of MODEL tree-aware (a pass-through outside a tree; safe to repeat);
    returns :func:`tree_layers`. TreeUnsupported, with nothing changed, if some layer cannot be."""
    layers = tree_layers(model, cache)
    for kind, layer, _ in layers:
        if kind == "gdn":
            swap_class(layer, _tree_class(_TreeGdn, type(layer)))
        else:
            swap_class(layer, _tree_class(_TreeAttention, type(layer)))
            swap_class(layer.rope, _tree_class(_TreeRope, type(layer.rope)))
    return layers
