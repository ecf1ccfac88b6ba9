"""Native MTP heads: finding their weights in a checkpoint, and building the head of its family."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...compat import pipeline_size
from ...errors import InvalidCheckpointError, UsageError
from ..trunk import split_trunk
from .head import MTPHead, QwenMTPHead, shard_head, text_args, to_switch_mlp
from .weights import MTPWeights, find_mtp_weights

__all__ = ["MTPHead", "MTPWeights", "find_mtp_weights", "load_mtp_head", "head_layout"]

# a Qwen head on a target sharded by mlx.launch: split like the target, or whole on every rank.
# Split by default: on two H200s over NCCL it ran 1.06x (8B shape) and 1.19x (27B) the whole
# head's speed, paired medians of 8 reps (docs/distributed.md)
LAYOUT_ENV = "MLXSPEC_MTP_HEAD"
LAYOUTS = ("split", "whole")
DEFAULT_LAYOUT = "split"


def head_layout() -> str:
    """``whole`` or ``split``, from $MLXSPEC_MTP_HEAD (UsageError for anything else)."""
    raw = os.environ.get(LAYOUT_ENV, "").strip() or DEFAULT_LAYOUT
    if raw not in LAYOUTS:
        raise UsageError(f"{LAYOUT_ENV} must be one of {', '.join(LAYOUTS)} (got {raw!r})")
    return raw


def load_mtp_head(model: nn.Module, path: Path, config: dict, group=None) -> MTPHead | None:
    """The checkpoint's MTP head bound to ``model``'s trunk, or None when it ships none. GROUP:
    the target is sharded over it; a Qwen head is then split too when :func:`head_layout` says
    ``split`` and the target is split by tensors (a head on a pipeline-parallel target stays
    whole: its all-sums and the stages' sends, queued in one graph, deadlocked two ranks; a
    DeepSeek/GLM nextn head stays whole)."""
    weights = find_mtp_weights(Path(path), config)
    if weights is None:
        return None
    if weights.family == "nextn":
        from .nextn import load_nextn_head

        return load_nextn_head(model, weights)
    if weights.family != "qwen3_5":
        raise InvalidCheckpointError(
            f"MTP heads of the {weights.family} family are not supported yet ({weights.source})"
        )
    args = text_args(model)
    module = QwenMTPHead(args, weights.num_layers)
    tensors = {k[len("mtp."):]: v for k, v in weights.tensors.items()}
    tensors = to_switch_mlp(tensors)
    if weights.quantization:
        q = weights.quantization
        nn.quantize(
            module,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 4),
            mode=q.get("mode", "affine"),
            class_predicate=lambda p, m: f"{p}.scales" in tensors,
        )
    try:
        module.load_weights(list(tensors.items()), strict=True)
    except ValueError as err:
        msg = " ".join(str(err).split())[:200]
        raise InvalidCheckpointError(f"MTP head in {weights.source} does not fit the model: {msg}")
    module.eval()
    mx.eval(module.parameters())
    nbytes = sum(v.nbytes for v in weights.tensors.values())
    if group is not None and group.size() > 1 and head_layout() == "split" and pipeline_size(model) == 1:
        from mlx.utils import tree_flatten

        shard_head(module, group)
        nbytes = sum(v.nbytes for _, v in tree_flatten(module.parameters()))  # this rank's part
    return MTPHead(module, split_trunk(model), nbytes, weights.source)
