"""Sibling quantized layers of one input in one tensor-core call: q, k and v; gate and up.

A verify forward on MLX's CUDA backend is host-bound: building and launching a forward of the
8B shape costs the host about as long as the device takes to run it, and each call costs the
host its own share (``docs/benchmarks.md``). mlx-lm's attention and MLP blocks call their
projections one after another on one array (``self.q_proj(x), self.k_proj(x),
self.v_proj(x)``), so here the first member of a group called with x runs the whole group's
call (:func:`.qmm_tc.fused_quantized_matmul`) and each other member, called with that same
array object, takes its output from it: per layer of the 8B shape, 3 calls instead of 7.

Exactness: each output is, bit for bit, what the member's own tensor-core call computes (a
group holds only matrices of one K split). The small k and v projections, which alone keep
MLX's matmul (:data:`.qmm.MIN_WEIGHT_BYTES`), ride along in the group's call. A member called
with another array, or with rows the tensor-core kernel does not take (decode's 1 row, more
than :data:`.qmm.TC_SPLIT_MAX`, the kernels off), runs its own route as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import qmm, qmm_tc

# Children of one module that mlx-lm calls on the same input, one after another: attention's
# projections, the MLP's, and the linear-attention input projections of Qwen3-Next / Qwen3.5.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkvz", "in_proj_ba"),
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


class FusedCall:
    """One group's call: computed when a member asks for an input it has not computed (or
    whose output that member took already), kept until every member has taken its output."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.group_size = members[0].group_size
        self.x: mx.array | None = None
        self.out: list[mx.array | None] = [None] * len(members)
        self.calls = 0  # fused calls made (tests read it)

    def take(self, index: int, x: mx.array) -> mx.array:
        if self.x is not x or self.out[index] is None:
            self.out = qmm_tc.fused_quantized_matmul(
                x, [(m["weight"], m["scales"], m["biases"]) for m in self.members], group_size=self.group_size)
            self.x = x
            self.calls += 1
        y, self.out[index] = self.out[index], None
        if all(o is None for o in self.out):
            self.x = None  # every member served: hold nothing
        return y


class FusedMember:
    """A member's kernel in :mod:`.qmm`'s routing (``kernel(x, w, scales, biases, ...)``): its
    output of the group's call; its own weights are the group's."""

    def __init__(self, call: FusedCall, index: int):
        self.call, self.index = call, index

    def __call__(self, x: mx.array, *_, **__) -> mx.array:
        return self.call.take(self.index, x)


def _key(m: nn.Module) -> tuple | None:
    """What members of one call share (None: not a member): a layer :mod:`.qmm` swapped to its
    plain class whose layout the tensor-core kernel takes."""
    if type(m) is not qmm.SmallMQuantizedLinear or not m.tc_layout:
        return None
    return m.kernel_dtype, m.group_size, m.bits, m["weight"].shape[1]


def install(model: nn.Module) -> int:
    """Group MODEL's sibling layers (:data:`SIBLINGS`, after :func:`.qmm.install`) into fused
    calls: those of one layout, K and K split, at least two, with at least
    :data:`.qmm.MIN_WEIGHT_BYTES` of weights between them. Returns how many groups it made."""
    made = 0
    for _, module in model.named_modules():
        if not isinstance(module, nn.Module):
            continue
        for names in SIBLINGS:
            layers = [module.get(n) for n in names]
            layers = [m for m in layers if isinstance(m, nn.Module) and _key(m) is not None]
            classes: dict[tuple, list[nn.Module]] = {}
            for m in layers:
                k = m["weight"].shape[1] * 32 // m.bits
                classes.setdefault((_key(m), qmm_tc.split_k(m["weight"].shape[0], k, 2)), []).append(m)
            for members in classes.values():
                if len(members) < 2 or sum(m.weight_bytes for m in members) < qmm.MIN_WEIGHT_BYTES:
                    continue
                call = FusedCall(members)
                for i, m in enumerate(members):
                    m.fused = FusedMember(call, i)
                made += 1
    return made
