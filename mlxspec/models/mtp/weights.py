"""Find and read a checkpoint's native MTP / NextN head tensors (mlx-lm drops them on load).

The steps, one module each: which families have a head and how its tensors are named
(:mod:`.names`); where the tensors live (:mod:`.locate`, lazily: only the head's tensors are
ever read from disk); how they are quantized (:mod:`.quantization`); whether every tensor is
there with the right shape (:mod:`.validate`); and the +1 that zero-centred Qwen norms need
(:mod:`.norms`).

Tensors keep their stored dtype and are never dequantized. The names and shapes are those of
the published checkpoints and of vLLM's and sglang's MTP loaders.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidCheckpointError
from .locate import locate
from .names import QWEN_TYPES, configured_layers, mtp_model_type, normaliser, text_config
from .norms import shift_zero_centred
from .quantization import quantization
from .validate import validate_head


@dataclass
class MTPWeights:
    family: str  # "qwen3_5" or "nextn"
    tensors: dict[str, mx.array]  # normalised names: "mtp.fc.weight", "nextn.layers.0.eh_proj.weight"
    num_layers: int
    source: str  # human-readable: "mtp.safetensors", "model.safetensors.index.json (1 of 2 shards)"
    quantization: dict | None  # {"group_size", "bits", "mode"} (+ per-module overrides) or None
    norms_shifted: bool  # zero-centred RMSNorm weights were converted (+1) to mlx's convention


def find_mtp_weights(model_path: Path, config: dict) -> MTPWeights | None:
    """The checkpoint's native MTP / NextN head tensors, or None when it has no head.

    Raises InvalidCheckpointError (one line, naming the tensor) when a head is present but a
    tensor is missing or mis-shaped.
    """
    model_path = Path(model_path)
    model_type = mtp_model_type(config)
    if model_type is None:
        return None
    family = "qwen3_5" if model_type in QWEN_TYPES else "nextn"
    configured = configured_layers(config, family)
    if configured == 0:
        return None
    found = locate(model_path, normaliser(family, config))
    if found is None:
        return None  # e.g. an mlx-lm conversion: its sanitize drops the head
    tensors = found.tensors

    if configured is None:  # Qwen3-Next has no count in its config: count the layers present
        layers = {int(m.group(1)) for k in tensors
                  if (m := re.match(r"^(?:mtp|nextn)\.layers\.(\d+)\.", k))}
        configured = max(layers) + 1 if layers else 0
        if configured == 0:
            raise InvalidCheckpointError(f"MTP head in {found.source} has no layers")

    quant = quantization(tensors, config, family)
    validate_head(tensors, found.source, quant.get("mode") if quant else None, text_config(config),
                  model_type, family, configured)
    # DeepSeek / GLM norms are standard (x * w): never shifted
    shifted = family == "qwen3_5" and shift_zero_centred(tensors, found.trunk_raw)
    return MTPWeights(
        family=family,
        tensors=tensors,
        num_layers=configured,
        source=found.source,
        quantization=quant,
        norms_shifted=shifted,
    )
