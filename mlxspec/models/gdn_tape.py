"""Tape replay for GatedDeltaNet rollback (Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids).

A verify forward over S tokens records, per linear-attention layer, what it fed the
recurrence: the conv input (state rows + new rows) and the post-conv q, k, v with the gate
inputs a, b. When only m of the S tokens are accepted, the conv state is a slice of the conv
input and the recurrent state is m steps of mlx-lm's own ``gated_delta_update`` from the
snapshot taken before the verify: the same arithmetic as the verify's own first m steps, with
no projection weights read again (a full re-forward reads the whole model). On CUDA both run
mlxspec's fused kernel (:mod:`mlxspec.kernels.gdn`), one launch a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from ..compat import sharding_group, swap_class
from ..kernels.gdn import gated_delta_update  # mlx-lm's own, or the CUDA kernel there


@dataclass
class Tape:
    conv_input: mx.array  # (B, K-1+S, C): conv state rows, then the S new rows
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array


class _Taping:
    """Mixin over an mlx-lm GatedDeltaNet class: records a :class:`Tape` on its cache when
    ``cache.record_tape`` is set. Otherwise it is mlx-lm's layer unchanged. Taping, it performs
    the same operations as the layer's own ``__call__`` for one unpadded sequence (the
    projections come from :meth:`_project`, the rest is shared by both classes)."""

    def _project(self, inputs: mx.array):  # -> (pre-conv qkv, z, a, b)
        raise NotImplementedError

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        taping = getattr(cache, "record_tape", False)
        if not taping or mask is not None:
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        qkv, z, a, b = self._project(inputs)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = mx.contiguous(conv_input[:, -(self.conv_kernel_size - 1) :, :])
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        out, state = gated_delta_update(
            q, k, v, a, b, self.A_log, self.dt_bias, cache[1], None, use_kernel=not self.training
        )
        cache.tape = Tape(conv_input, q, k, v, a, b)
        cache[1] = state
        cache.advance(S)
        out = self.out_proj(self.norm(out, z).reshape(B, S, -1))
        # a tensor-parallel shard (mlx-lm's shard()) holds some heads: the tape, and so the
        # rollback, is of this rank's heads; the output sums every rank's, as mlx-lm's layer does
        group = sharding_group(self)
        return out if group is None else mx.distributed.all_sum(out, group=group)

    def replay(self, tape: Tape, state_before, m: int) -> tuple[mx.array, mx.array]:
        """(conv state, recurrent state) after the first m of the taped tokens."""
        conv = mx.contiguous(tape.conv_input[:, m : m + self.conv_kernel_size - 1, :])
        return conv, self._replayed_state(tape, state_before, m, None)

    def replay_rows(self, tape: Tape, state_before, counts: RowCounts) -> tuple[mx.array, mx.array]:
        """(conv states, recurrent states) of a batch's rows after the first ``counts.kept[i]``
        of row i's taped tokens: one gather for the conv states and one recurrence over the
        largest count, masked past each row's own (a masked step leaves the state as it was; the
        kept steps are the same arithmetic as :meth:`replay`'s, so each row gets the bits it
        would alone). A :meth:`replay` per distinct count built, besides its recurrence calls
        (one a count, each with its gates' ops), 10, 18 and 30 ops a layer for 4 rows of 1, 2
        and 4 counts (counted on the CPU); this builds a gather and at most 5 slices. On one
        H100, rolling back 4 rows of the 27B shape the old way cost 5.7 ms a step
        (docs/benchmarks.md)."""
        span = self.conv_kernel_size - 1
        conv = mx.take_along_axis(tape.conv_input, counts.conv_positions(span, tape.conv_input.shape[-1]), axis=1)
        return conv, self._replayed_state(tape, state_before, counts.steps, counts.mask)

    def _replayed_state(self, tape: Tape, state_before, n: int, mask: mx.array | None):
        """The recurrent state after the first N taped steps (MASK (B, N): a row's steps past
        its own count leave its state as it was), both replays' one recurrence call."""
        if n == 0:
            return state_before
        q, k, v, a, b = (x if x.shape[1] == n else x[:, :n] for x in (tape.q, tape.k, tape.v, tape.a, tape.b))
        _, state = gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias, state_before, mask,
                                      use_kernel=not self.training)
        return state


class RowCounts:
    """How many taped tokens a batch's rollback keeps of each row (KEPT[i] of row i), with what
    every layer's :meth:`_Taping.replay_rows` shares, made once a rollback: the mask of the
    kept steps (B, max(KEPT)) or None where every row keeps them all, and the conv states'
    gather positions."""

    def __init__(self, kept: list[int]):
        self.kept = kept
        self.steps = max(kept)
        self._first = mx.array(kept, mx.int32)
        self.mask = None if min(kept) == self.steps else mx.arange(self.steps)[None, :] < self._first[:, None]
        self._positions: dict[tuple[int, int], mx.array] = {}

    def conv_positions(self, span: int, channels: int) -> mx.array:
        """Row i's conv state after its count: positions KEPT[i] .. KEPT[i] + SPAN - 1 of its
        conv input, (B, SPAN, CHANNELS)."""
        key = (span, channels)
        if key not in self._positions:
            at = self._first[:, None, None] + mx.arange(span, dtype=mx.int32)[None, :, None]
            self._positions[key] = mx.broadcast_to(at, (len(self.kept), span, channels))
        return self._positions[key]


class TapedGatedDeltaNet(_Taping, GatedDeltaNet):
    """Qwen3.5 / Qwen3.6 (dense and MoE)."""

    def _project(self, inputs):
        B, S, _ = inputs.shape
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(inputs), z, self.in_proj_a(inputs), self.in_proj_b(inputs)


class TapedQwen3NextGatedDeltaNet(_Taping, Qwen3NextGatedDeltaNet):
    """Qwen3-Next: q, k, v, z and b, a come interleaved from two projections."""

    def _project(self, inputs):
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, a, b


TAPED = {GatedDeltaNet: TapedGatedDeltaNet, Qwen3NextGatedDeltaNet: TapedQwen3NextGatedDeltaNet}


def tape_layers(model: nn.Module, cache: list) -> list[_Taping] | None:
    """Enable taping on every linear-attention layer, paired with its cache entry, or None
    when some recurrent cache belongs to a layer this module cannot tape."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != len(cache):
        return None
    taped = []
    for layer, c in zip(layers, cache):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            if hasattr(c, "cache"):  # a recurrent cache on a layer we do not know
                return None
            continue
        if type(gdn) in TAPED:
            swap_class(gdn, TAPED[type(gdn)])  # same module, same weights, tape on demand
        if not isinstance(gdn, _Taping):
            return None
        taped.append(gdn)
    return taped
