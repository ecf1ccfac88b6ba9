"""Read the outputs of chosen decoder layers of a target as it runs (DFlash drafters are fed
them): each chosen layer becomes a subclass of its own class that, while a capture is
attached, keeps its output. The model's own ``__call__`` runs unchanged, so the logits are
exactly those of plain decoding."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..compat import pipeline_size, swap_class
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


class _Sink:
    """A layer's captured outputs; not a list, so MLX does not take it for a parameter tree."""

    def __init__(self):
        self.rows: list[mx.array] = []


class LayerCapture:
    """Outputs of layers ``ids`` of MODEL, per forward, concatenated along features."""

    def __init__(self, model: nn.Module, ids: tuple[int, ...] | list[int]):
        stages = pipeline_size(model)
        if stages > 1:  # model.layers is this stage's only: an index would name another layer
            raise DrafterError(f"the drafter reads the target's layer outputs, and this target is split by layers "
                               f"over {stages} processes (pipeline parallel), each holding some of them: use "
                               "--drafter pld, mtp or draft")
        layers = decoder_layers(model)
        bad = [i for i in ids if not 0 <= i < len(layers)]
        if bad:
            raise DrafterError(f"the drafter reads target layers {list(ids)}, but the target has {len(layers)}")
        self.layers = [layers[i] for i in ids]
        self.sinks = [_Sink() for _ in ids]
        for layer, sink in zip(self.layers, self.sinks):
            if type(layer) not in _CAPTURING.values():
                swap_class(layer, _capturing_class(type(layer)))
            layer._capture_sink = sink

    def take(self) -> mx.array | None:
        """The captured rows of the forwards since the last call, (n, len(ids) * H); None when
        nothing ran."""
        if not self.sinks[0].rows:
            return None
        parts = [mx.concatenate(s.rows, axis=1) if len(s.rows) > 1 else s.rows[0] for s in self.sinks]
        for s in self.sinks:
            s.rows.clear()
        return mx.concatenate(parts, axis=-1)[0]

    def close(self) -> None:
        """Stop keeping outputs (the layers stay of the capturing class: a plain pass-through)."""
        for layer, sink in zip(self.layers, self.sinks):
            if getattr(layer, "_capture_sink", None) is sink:
                layer._capture_sink = None
            sink.rows.clear()
