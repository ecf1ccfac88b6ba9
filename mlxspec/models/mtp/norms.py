"""Qwen MTP heads' RMSNorm weights: stored zero-centred or not, and the +1 that converts them.

Hugging Face Qwen3.5 / Qwen3-Next checkpoints store every RMSNorm weight as an offset
(``y = norm(x) * (1 + w)``, initialised to 0); mlx-lm's modules compute ``norm(x) * w``, so
such weights need +1. DeepSeek / GLM NextN norms are standard (``x * w``) and never shifted.
"""

from __future__ import annotations

import mlx.core as mx

# Qwen head norms stored zero-centred by Hugging Face checkpoints (y = norm(x) * (1 + w))
QWEN_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)

# below this median |w| the head's norm weights are taken as zero-centred (see _zero_centred)
ZERO_CENTRED_MEDIAN = 0.5


def _qwen_norm_names(tensors: dict) -> list[str]:
    return sorted(
        k for k in tensors
        if (k == "mtp.norm.weight" or k.endswith(QWEN_NORM_SUFFIXES)) and tensors[k].ndim == 1
    )


def _zero_centred(tensors: dict, trunk_raw: bool | None, norm_names: list[str]) -> bool:
    """Whether the Qwen head's RMSNorm weights are stored zero-centred (raw Hugging Face).

    The rule, in order:

    1. The head was read from the same files as the trunk and the trunk shows a ``conv1d.weight``
       whose last dim != 1 (``trunk_raw``): an unconverted Hugging Face checkpoint, exactly the
       test mlx-lm's ``qwen3_5.sanitize`` uses to add +1 to the trunk's norms -> zero-centred.
    2. Otherwise (a sidecar, whose conversion state the trunk says nothing about; a trunk already
       converted by mlx-lm, whose sanitize drops ``mtp.*`` and so never shifted a head stored
       with it; or no trunk conv1d visible): the head's own norm weights decide. Trained
       zero-centred offsets sit near 0, converted gains near 1: zero-centred when the median
       |w| over all the head's norm weights is below ``ZERO_CENTRED_MEDIAN`` (0.5).
    """
    if trunk_raw:
        return True
    if not norm_names:
        return False
    values = mx.concatenate([tensors[k].astype(mx.float32).reshape(-1) for k in norm_names])
    median = float(mx.sort(mx.abs(values))[values.size // 2].item())
    return median < ZERO_CENTRED_MEDIAN


def shift_zero_centred(tensors: dict, trunk_raw: bool | None) -> bool:
    """Add 1 to a Qwen head's norm weights in ``tensors`` when they are stored zero-centred;
    whether it did."""
    norm_names = _qwen_norm_names(tensors)
    if not _zero_centred(tensors, trunk_raw, norm_names):
        return False
    for k in norm_names:
        tensors[k] = tensors[k] + 1  # python scalar: the stored dtype is kept
    return True
