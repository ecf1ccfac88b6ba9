"""Attention-only Qwen3.5 checkpoints (``full_attention_interval: 1``): two things mlx-lm misses.

1. Norms. Hugging Face Qwen3.5 checkpoints store RMSNorm weights as offsets (``y = norm(x) * (1 + w)``).
mlx-lm's ``qwen3_5.sanitize`` adds the 1 only when it sees an unconverted GatedDeltaNet
``conv1d.weight``; a config with ``full_attention_interval: 1`` (every layer full attention: the
mini-attn benchmark model) has none, so mlx-lm would load its norms as gains near 0. Such a
checkpoint is still recognisable as raw by its Hugging Face key names
(``model.language_model.*``; mlx-lm saves ``language_model.model.*``).

2. Masks. mlx-lm's text model takes its GatedDeltaNet mask from ``cache[ssm_idx]`` with
``ssm_idx = 0`` fixed at construction; with no GDN layer that entry is a KVCache and decoding
with a cache fails. mlx-lm's own ``pipeline()`` sets ``ssm_idx = None`` in that case: so do we.
"""

from __future__ import annotations

from pathlib import Path

from ..compat import drop_ssm_mask

NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                 ".k_norm.weight", "model.norm.weight")
_FAMILY = ("qwen3_5", "qwen3_5_moe")


def _attention_only(config: dict) -> bool:
    text = config.get("text_config") or config
    types = text.get("layer_types")
    if types:
        return "linear_attention" not in types
    return text.get("full_attention_interval") == 1


def is_attention_only(config: dict) -> bool:
    return config.get("model_type") in _FAMILY and _attention_only(config)


def needs_norm_shift(path: Path, config: dict) -> bool:
    """A raw (Hugging Face layout) Qwen3.5 checkpoint without GatedDeltaNet layers."""
    if not is_attention_only(config):
        return False
    import mlx.core as mx

    files = sorted(Path(path).glob("model*.safetensors"))  # mx.load is lazy: only names are read
    return any(k.startswith("model.language_model.") for f in files for k in mx.load(str(f)))


def is_trunk_norm(name: str) -> bool:
    return name.endswith(NORM_SUFFIXES) and ".mtp." not in f".{name}"


def fix_loaded(model, path: Path, config: dict) -> None:
    """Both fixes on a model mlx-lm loaded from PATH (nothing for other models)."""
    if not is_attention_only(config):
        return
    text_model = model.language_model.model
    if all(not layer.is_linear for layer in text_model.layers):
        drop_ssm_mask(text_model)
    if needs_norm_shift(path, config):
        shift_loaded_norms(model)


def shift_loaded_norms(model) -> None:
    """Add the 1 mlx-lm's sanitize skipped to a loaded model's trunk norms."""
    from mlx.utils import tree_flatten

    updates = [(k, v + 1.0) for k, v in tree_flatten(model.parameters()) if is_trunk_norm(k) and v.ndim == 1]
    model.load_weights(updates, strict=False)


def shift_saved_norms(folder: Path) -> None:
    """The same fix on a checkpoint mlx-lm's convert wrote (its sanitize skipped the 1 too)."""
    import mlx.core as mx

    for f in sorted(Path(folder).glob("model*.safetensors")):
        arrays, meta = mx.load(str(f), return_metadata=True)
        arrays = {k: (v + 1.0).astype(v.dtype) if is_trunk_norm(k) and v.ndim == 1 else v
                  for k, v in arrays.items()}
        mx.save_safetensors(str(f), arrays, metadata=meta)
