"""Sibling projections in one small-M call: q/k/v and gate/up read the same input.

A verify forward on MLX's CUDA backend is host-bound (a 1-token 8B forward: 8-11 ms where its
weights need about 1.5 ms of memory time), and each custom kernel call costs about 10 us of
host time. Stacking a layer's q/k/v and its gate/up matrices makes 4 small-M calls a layer
instead of 7, and the k/v projections (2 MB each on 8B, too small for the kernel alone) ride
along with q. The stacked weights are one array; each layer keeps a row view of it, so the
model holds no second copy and 1-row decoding still runs MLX's own kernel on the views.

The first sibling called with an input computes all outputs; the others take theirs when
called with the same input object (MLX arrays are immutable, so the same object means the
same values). Anything else (another input, weights replaced since, the kernels switched off)
runs the layer on its own, as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..compat import swap_class
from . import qmm
from .switch import active

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PARTS = ("weight", "scales", "biases")


class SiblingGroup:
    """Layers whose weights are row views of one stacked quantized matrix."""

    def __init__(self, members: list[nn.QuantizedLinear]):
        self.members = members
        self.group_size, self.bits = members[0].group_size, members[0].bits
        self.stacked = {p: mx.concatenate([m[p] for m in members]) for p in _PARTS}
        mx.eval(self.stacked)
        edges = [0]
        for m in members:
            edges.append(edges[-1] + m["weight"].shape[0])
        self.bounds = tuple(edges[1:-1])
        self.views = []
        for m, lo, hi in zip(members, edges, edges[1:]):
            view = {p: self.stacked[p][lo:hi] for p in _PARTS}
            mx.eval(view)
            m.update(view)
            self.views.append(view)
        self.x: mx.array | None = None
        self.outputs: list[mx.array] = []
        self.taken: set[int] = set()

    def intact(self) -> bool:
        """Every member still holds its view (a later update or cast replaced none)."""
        return all(m[p] is v[p] for m, v in zip(self.members, self.views) for p in _PARTS)

    def output(self, index: int, x: mx.array) -> mx.array:
        if self.x is not x:
            self.outputs = qmm.stacked_matmul(x, self.stacked["weight"], self.stacked["scales"],
                                              self.stacked["biases"], self.bounds,
                                              group_size=self.group_size, bits=self.bits)
            self.x, self.taken = x, set()
        y = self.outputs[index]
        self.taken.add(index)
        if len(self.taken) == len(self.members):  # all served: hold no activations between calls
            self.x, self.outputs = None, []
        return y


class StackedQuantizedLinear(qmm.SmallMQuantizedLinear):
    """A q/k/v or gate/up layer whose 2..8-row calls go through its :class:`SiblingGroup`."""

    def __call__(self, x):
        group: SiblingGroup = self._sibling_group
        rows = x.size // x.shape[-1]
        if not (qmm.MIN_ROWS <= rows <= qmm.MAX_ROWS and active() and x.dtype == self["scales"].dtype
                and group.intact()):
            return super().__call__(x)
        y = group.output(self._sibling_index, x)
        return y + self["bias"] if "bias" in self else y


def _candidates(module: nn.Module, names: tuple[str, ...]) -> list[nn.QuantizedLinear] | None:
    members = [getattr(module, n, None) for n in names]
    if not all(isinstance(m, nn.QuantizedLinear) for m in members):
        return None
    first = members[0]
    same = all(m.group_size == first.group_size and m.bits == first.bits
               and getattr(m, "mode", "affine") == getattr(first, "mode", "affine")
               and m["weight"].shape[1] == first["weight"].shape[1] and m["scales"].dtype == first["scales"].dtype
               for m in members)
    if not same or not qmm.eligible(first["scales"].dtype, first["weight"], first["scales"], first.get("biases"),
                                    first.group_size, first.bits, getattr(first, "mode", "affine")):
        return None
    if sum(m["weight"].nbytes for m in members) < qmm.MIN_WEIGHT_BYTES:
        return None  # small together too: MLX's matmul per row costs less than a custom call
    return members


def install(model: nn.Module) -> int:
    """Stack every module's q/k/v and gate/up quantized layers (where all are there and
    share a layout) and make them :class:`StackedQuantizedLinear`. Returns the groups made."""
    groups = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            members = _candidates(module, names)
            if members is None or any(isinstance(m, StackedQuantizedLinear) for m in members):
                continue
            group = SiblingGroup(members)
            for index, m in enumerate(members):
                swap_class(m, StackedQuantizedLinear)
                m._sibling_group, m._sibling_index = group, index
            groups += 1
    return groups
