"""Where a checkpoint keeps its MTP head's tensors, read lazily.

In the order looked at: a sidecar (``mtp.safetensors``, ``mtp/weights.safetensors``,
``model-mtp.safetensors``); the main shards through ``model.safetensors.index.json``; the
``model*.safetensors`` files themselves. Files are opened with ``mx.load``, which is lazy: only
the head's tensors are ever read from disk. Alongside the head, what the trunk stored in the
same files says about its conversion state (raw Hugging Face or converted by mlx-lm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidCheckpointError

SIDECARS = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")
INDEX = "model.safetensors.index.json"


@dataclass
class Found:
    tensors: dict  # normalised name -> stored (lazy) array
    source: str  # human-readable: "mtp.safetensors", "model.safetensors.index.json (1 of 2 shards)"
    trunk_raw: bool | None  # conversion state of the trunk stored in the same files as the head


def _load(path: Path, model_path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))  # lazy: nothing is read until a tensor is evaluated
    except Exception as err:  # mlx raises ValueError/RuntimeError for broken files
        msg = " ".join(str(err).split())[:160]
        raise InvalidCheckpointError(f"cannot read {path.relative_to(model_path)}: {msg}") from None


def _pick(arrays: dict, normalise, where: str, out: dict) -> None:
    for key, value in arrays.items():
        name = normalise(key)
        if name is None:
            continue
        if name in out:
            raise InvalidCheckpointError(f"MTP head tensor {name} appears twice ({key} in {where})")
        out[name] = value


def _trunk_raw(arrays: dict, normalise) -> bool | None:
    """mlx-lm's rule: a trunk ``conv1d.weight`` whose last dim != 1 is an unconverted HF tensor.

    True (raw HF trunk), False (converted by mlx-lm), None (no trunk conv1d visible).
    """
    seen = None
    for key, value in arrays.items():
        if key.endswith("conv1d.weight") and normalise(key) is None:
            if value.shape[-1] != 1:
                return True
            seen = False
    return seen


def _sidecar(model_path: Path, normalise) -> Found | None:
    for name in SIDECARS:
        path = model_path / name
        if path.is_file():
            tensors: dict = {}
            _pick(_load(path, model_path), normalise, name, tensors)
            if not tensors:
                raise InvalidCheckpointError(f"{name} holds no MTP head tensors")
            # a sidecar carries no trunk: its own norm statistics decide
            return Found(tensors, name, None)
    return None


def _indexed(model_path: Path, normalise) -> Found | None:
    index = model_path / INDEX
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise InvalidCheckpointError(f"{INDEX} is not a valid index: {type(err).__name__}") from None
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if normalise(key) is not None:
            by_shard.setdefault(shard, []).append(key)
    if not by_shard:
        return None
    tensors: dict = {}
    for shard, keys in sorted(by_shard.items()):
        path = model_path / shard
        if not path.is_file():
            raise InvalidCheckpointError(f"{INDEX} names {shard} for MTP tensor {keys[0]}, but the file is missing")
        arrays = _load(path, model_path)
        missing = [k for k in keys if k not in arrays]
        if missing:
            raise InvalidCheckpointError(f"{INDEX} puts {missing[0]} in {shard}, but that file lacks it")
        _pick({k: arrays[k] for k in keys}, normalise, shard, tensors)
    trunk_raw = None
    conv = next((k for k in weight_map if k.endswith("conv1d.weight") and normalise(k) is None), None)
    if conv is not None and (model_path / weight_map[conv]).is_file():
        shard_arrays = _load(model_path / weight_map[conv], model_path)
        if conv in shard_arrays:
            trunk_raw = shard_arrays[conv].shape[-1] != 1
    n_shards = len(set(weight_map.values()))
    return Found(tensors, f"{INDEX} ({len(by_shard)} of {n_shards} shards)", trunk_raw)


def _shards(model_path: Path, normalise) -> Found | None:
    files = [p for p in sorted(model_path.glob("model*.safetensors")) if p.name not in SIDECARS]
    tensors: dict = {}
    used, trunk_raw = [], None
    for path in files:
        arrays = _load(path, model_path)
        before = len(tensors)
        _pick(arrays, normalise, path.name, tensors)
        if len(tensors) > before:
            used.append(path.name)
        raw = _trunk_raw(arrays, normalise)
        trunk_raw = raw if trunk_raw is None else (trunk_raw or bool(raw))
    if not tensors:
        return None
    return Found(tensors, ", ".join(used), trunk_raw)


def locate(model_path: Path, normalise) -> Found | None:
    """The head's tensors (names through ``normalise``), or None when no file holds any."""
    found = _sidecar(model_path, normalise)
    if found is not None:
        return found
    if (model_path / INDEX).is_file():
        return _indexed(model_path, normalise)
    return _shards(model_path, normalise)
