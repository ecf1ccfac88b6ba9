"""Every use of an mlx-lm internal, in one place.

mlxspec leans on a few things mlx-lm does not promise to keep: a private function, a private
attribute, model modules that look functions up by name at call time, layers whose class may be
swapped on a live instance. Each is wrapped here by one small named function, so an mlx-lm
upgrade that changes one fails in ``tests/test_compat.py`` (which exercises every function
against the installed mlx-lm) rather than somewhere inside a generation; pyproject.toml bounds
mlx-lm to the versions that test has passed with.

The lowest layer of the package: it imports only the standard library at import time, and mlx /
mlx-lm inside its functions.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable


def model_classes(config: dict) -> tuple[type, type]:
    """(Model, ModelArgs) for a config via private ``mlx_lm.utils._get_classes`` (ValueError if
    unsupported): the only way to ask whether mlx-lm supports a model_type without loading it."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def ring_index(cache) -> int:
    """A ``RotatingKVCache``'s private ``_idx`` (its write position): rollback cuts a ring there."""
    return cache._idx


def set_ring_index(cache, index: int) -> None:
    """Set a ``RotatingKVCache``'s private ``_idx``: rollback and snapshot restore move it."""
    if not hasattr(cache, "_idx"):
        raise AttributeError(f"{type(cache).__name__} has no ring index")
    cache._idx = index


def rebind(module: ModuleType, name: str, fn: Callable) -> Callable | None:
    """Point ``module.name`` at ``fn``, returning the old value: mlx-lm model modules look their
    imported functions up by name at call time, so this reroutes all their layers (kernels)."""
    previous = getattr(module, name, None)
    setattr(module, name, fn)
    return previous


def swap_class(obj: Any, cls: type) -> None:
    """Make a live mlx / mlx-lm layer a ``cls`` (a subclass of its class): their layers keep all
    state in the instance, so weights stay and only behaviour changes (kernels, taping)."""
    if not issubclass(cls, type(obj)):
        raise TypeError(f"{cls.__name__} does not extend {type(obj).__name__}")
    obj.__class__ = cls


def unswap_class(obj: Any) -> bool:
    """Undo :func:`swap_class`: make OBJ the nearest class of its own ancestry that is not
    mlxspec's (mlx-lm's layer again). Returns whether it changed."""
    own = lambda c: c.__module__ == "mlxspec" or c.__module__.startswith("mlxspec.")  # noqa: E731
    if not own(type(obj)):
        return False
    obj.__class__ = next(c for c in type(obj).__mro__ if not own(c))
    return True


def drop_ssm_mask(text_model) -> None:
    """Set a Qwen3.5 text model's ``ssm_idx`` to None, as mlx-lm's own ``pipeline()`` does when
    no layer is GatedDeltaNet: otherwise it reads a mask from a KVCache and fails."""
    if not hasattr(text_model, "ssm_idx"):
        raise AttributeError(f"{type(text_model).__name__} has no ssm_idx")
    text_model.ssm_idx = None


def hf_tokenizer(wrapper) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (its private
    ``_tokenizer``; anything else is returned as is): llguidance reads its vocabulary."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return wrapper._tokenizer if isinstance(wrapper, TokenizerWrapper) else wrapper


def final_softcap(lm) -> Callable | None:
    """The logit soft-cap LM (a text model with ``final_logit_softcapping``, as Gemma's) applies
    after its head, as its mlx-lm module computes it (gemma3n/gemma4_text: a compiled
    ``logit_softcap``), so logits made from the split trunk equal the model's own; None if none."""
    import sys
    from functools import partial

    cap = getattr(lm, "final_logit_softcapping", None)
    if not cap:
        return None
    fn = getattr(sys.modules.get(type(lm).__module__), "logit_softcap", None)
    if fn is not None:
        return partial(fn, cap)
    import mlx.core as mx

    return lambda x: mx.tanh(x / cap) * cap


def tree_attention_classes() -> tuple[type, ...]:
    """mlx-lm attention classes whose ``__call__(x, mask, cache)`` ropes queries and keys with
    ``self.rope(t, offset=cache.offset)``, appends them to the cache and hands ``mask`` unchanged
    to ``scaled_dot_product_attention``: a tree verify (models/tree_attention.py) gives them
    per-token positions and its own mask there (llama, qwen2, qwen2_moe, qwen3, qwen3_moe, and
    qwen3_next's, which qwen3_5 / qwen3_5_moe use)."""
    from mlx_lm.models import llama, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next

    return (llama.Attention, qwen2.Attention, qwen2_moe.Attention, qwen3.Attention,
            qwen3_moe.Attention, qwen3_next.Qwen3NextAttention)


def array_offset_ropes() -> tuple[type, ...]:
    """mlx-lm rope modules (``rope_utils.initialize_rope``'s) whose ``__call__(x, offset)`` hands
    ``offset`` to ``mx.fast.rope`` untouched, so an array of per-batch-item offsets works
    (``DynamicNTKScalingRoPE`` computes its base from the offset as a number: not it)."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE

    return (nn.RoPE, Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE)


def sharding_group(module) -> Any:
    """The ``mx.distributed`` group an mlx-lm layer's ``shard()`` left on it (``sharding_group``:
    the layer all-sums or gathers its output over it), or None for a whole layer."""
    return getattr(module, "sharding_group", None)


def gather_last_axis(x, group):
    """mlx-lm's gather of a last axis split over GROUP (``models.base.gather_last_axis``): a
    sharded lm_head's logits made whole, in rank order."""
    from mlx_lm.models.base import gather_last_axis as gather

    return gather(x, group)


def shard_qwen3_5_layers(layers: list, group) -> None:
    """Shard LAYERS (mlx-lm ``qwen3_5`` DecoderLayers: an MTP head's) over GROUP in place, as
    ``qwen3_5.Model.shard`` shards the trunk's own: that method is called on a stand-in whose
    ``layers`` are these and whose lm_head counts as tied (the head has none of its own)."""
    from types import SimpleNamespace

    from mlx_lm.models.qwen3_5 import Model

    tied = SimpleNamespace(args=SimpleNamespace(tie_word_embeddings=True))
    Model.shard(SimpleNamespace(layers=layers, language_model=tied), group)


def _pipelined_inner(model):
    """MODEL's inner model when mlx-lm's ``pipeline()`` split it over several processes (a
    ``PipelineMixin`` with ``pipeline_size`` > 1; a qwen3_5 model's sits under
    ``language_model``), else None."""
    for inner in (getattr(model, "model", None), getattr(getattr(model, "language_model", None), "model", None)):
        size = getattr(inner, "pipeline_size", None)
        if isinstance(size, int):
            return inner if size > 1 else None
    return None


def pipeline_size(model) -> int:
    """How many processes mlx-lm's ``pipeline()`` split MODEL's layers over, 1 when it did not."""
    inner = _pipelined_inner(model)
    return 1 if inner is None else inner.pipeline_size


def pipeline_stage(model) -> tuple[dict, int] | None:
    """This process's stage of a pipeline-parallel MODEL: ({layer number: layer} of the
    layers it runs, numbered as in the whole model, and the whole model's layer count), or
    None when MODEL is not split by layers. mlx-lm keeps the numbers (``layers[i]`` is layer
    i; the earlier ones are None here) between ``start_idx`` and ``end_idx``."""
    inner = _pipelined_inner(model)
    if inner is None:
        return None
    start, end = inner.start_idx, inner.end_idx
    total = next((n for owner in (model, getattr(model, "language_model", None), inner)
                  if isinstance(n := getattr(getattr(owner, "args", None), "num_hidden_layers", None), int)), None)
    if total is None:
        raise AttributeError(f"cannot tell how many layers the pipelined {type(model).__module__} model has")
    return {i: inner.layers[i] for i in range(start, end)}, total
