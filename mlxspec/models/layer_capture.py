"""Read the outputs of chosen decoder layers of a target as it runs (DFlash drafters are fed
them): each chosen layer becomes a subclass of its own class that, while a capture is
attached, keeps its output. The model's own ``__call__`` runs unchanged, so the logits are
exactly those of plain decoding.

On a target split by layers over several processes (mlx-lm's ``pipeline()``), each process
captures the chosen layers it runs and zeros for the others, and one all-sum after the
forward gives every process all of them (x + 0 is exact)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..compat import pipeline_stage, swap_class
from ..errors import DrafterError

_CAPTURING: dict[type, type] = {}


def _capturing_class(cls: type) -> type:
    if cls not in _CAPTURING:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            sink = getattr(self, "_capture_sink", None)
            if sink is not None:
                sink.rows.append(out)
            return out

        _CAPTURING[cls] = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
    return _CAPTURING[cls]


def decoder_layers(model: nn.Module) -> list:
    """The target's decoder layers: mlx-lm's ``Model.layers`` (which reaches through the text
    model a qwen3_5 or multimodal model wraps), as gdn_tape and tree_attention read them."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise DrafterError(f"cannot find the decoder layers of a {type(model).__module__} model")
    return layers


def _layers(model: nn.Module) -> tuple[dict, int]:
    """({layer number: layer} of the decoder layers this process runs, the whole model's
    count): all of them, or on a pipeline stage its own, numbered as in the whole model."""
    try:
        stage = pipeline_stage(model)
    except AttributeError as err:
        raise DrafterError(f"the drafter reads the target's layer outputs, and this pipelined target's: {err}")
    if stage is None:
        layers = decoder_layers(model)
        return dict(enumerate(layers)), len(layers)
    return stage


def layer_count(model: nn.Module) -> int:
    """The target's decoder layers in all: on a pipeline stage the whole model's, not the
    stage's (whose ``Model.layers`` lists only its own)."""
    return _layers(model)[1]


def capturing(model: nn.Module) -> bool:
    """Whether some capture is attached to a decoder layer of MODEL (its next forward keeps
    their outputs: a forward traced for a compiled graph must not hand them its placeholders)."""
    return any(getattr(layer, "_capture_sink", None) is not None for layer in getattr(model, "layers", ()) or ())


class _Sink:
    """A layer's captured outputs; not a list, so MLX does not take it for a parameter tree."""

    def __init__(self):
        self.rows: list[mx.array] = []

    def joined(self) -> mx.array:
        """The kept outputs as one array, (B, n, H)."""
        return mx.concatenate(self.rows, axis=1) if len(self.rows) > 1 else self.rows[0]


class LayerCapture:
    """Outputs of layers ``ids`` of MODEL, per forward, concatenated along features."""

    def __init__(self, model: nn.Module, ids: tuple[int, ...] | list[int]):
        held, total = _layers(model)
        bad = [i for i in ids if not 0 <= i < total]
        if bad:
            raise DrafterError(f"the drafter reads target layers {list(ids)}, but the target has {total}")
        self.ids = tuple(ids)
        self.pipelined = len(held) < total
        self.hidden_size = getattr(getattr(model, "args", None), "hidden_size", None)
        if self.pipelined and not isinstance(self.hidden_size, int):  # the zeros for others' layers need it
            raise DrafterError(f"cannot tell the width of the pipelined {type(model).__module__} model")
        self.layers = [held.get(i) for i in ids]  # None: run by another process of the pipeline
        self.sinks = [_Sink() for _ in ids]
        for layer in self.layers:
            if layer is not None and type(layer) not in _CAPTURING.values():
                swap_class(layer, _capturing_class(type(layer)))
        self.attach()

    def attach(self) -> None:
        """Make the next forward's outputs this capture's (anything kept before is dropped):
        several captures may share layers (a batch's and a joining row's own), each attached
        before the forward it reads and let go by :meth:`take`, so a forward no capture asked
        for keeps nothing."""
        for layer, sink in zip(self.layers, self.sinks):
            sink.rows.clear()
            if layer is not None:
                layer._capture_sink = sink

    def _let_go(self) -> None:
        for layer, sink in zip(self.layers, self.sinks):
            if layer is not None and getattr(layer, "_capture_sink", None) is sink:
                layer._capture_sink = None

    def take(self, batched: bool = False) -> mx.array | None:
        """The captured rows of the forwards since the last call, (n, len(ids) * H), or with
        BATCHED every row of the batch, (B, n, len(ids) * H); None when nothing ran. (A
        pipeline stage: :meth:`take_after`.)"""
        self._let_go()
        if not self.sinks[0].rows:
            return None
        parts = [s.joined() for s in self.sinks]
        for s in self.sinks:
            s.rows.clear()
        out = mx.concatenate(parts, axis=-1)
        return out if batched else out[0]

    def take_after(self, logits: mx.array) -> tuple[mx.array | None, mx.array]:
        """(:meth:`take`'s rows, LOGITS) for the forward that gave LOGITS (n, V). On a pipeline
        stage the rows are all-summed over the processes, the sum made to follow LOGITS and the
        returned logits to follow the sum: every process then meets that collective at the same
        place among the pipeline's own sends and gathers (in another order two ranks wait on
        each other), and before anything computed from these logits."""
        if not self.pipelined:
            return self.take(), logits
        self._let_go()
        n = logits.shape[0]
        parts = []
        for layer, sink in zip(self.layers, self.sinks):
            if layer is None:  # another process runs it: its zeros here
                parts.append(mx.zeros((1, n, self.hidden_size), mx.float32))
            else:
                parts.append(sink.joined().astype(mx.float32))
            sink.rows.clear()
        summed = mx.distributed.all_sum(mx.depends(mx.concatenate(parts, axis=-1), logits))
        return summed[0].astype(logits.dtype), mx.depends(logits, summed)

    def close(self) -> None:
        """Stop keeping outputs (the layers stay of the capturing class: a plain pass-through)."""
        self._let_go()
        for sink in self.sinks:
            sink.rows.clear()
