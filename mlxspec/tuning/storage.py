"""The stored tune records: where they live, which machine and model they belong to, and
the stored costs the engine reads instead of measuring again. A run that had to measure the
verify-cost curve stores it here too (:func:`save_cost`), so it is measured once per machine
and model."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
from functools import cache
from pathlib import Path

from ..engine.gates import CostModel
from ..hardware import detect
from ..models.staging import write_whole
from ..options import MODEL_DRAFTERS

FORMAT_VERSION = 1
DATA_ENV = "MLXSPEC_TUNE_DIR"  # overrides the folder the results live in (tests, CI)


def slug(text: str, limit: int = 48) -> str:
    """``text`` as a lower-case file name: runs of other characters become one '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip()).strip("-.").lower()
    return name[:limit] or "unknown"


@cache
def machine_info() -> dict:
    """Platform, CPU and (when MLX runs on one) GPU name of this machine, and its key."""
    profile = detect(fast=True)  # the GPU name comes from MLX, so system_profiler is not needed
    gpu = None
    if profile.mlx_device == "gpu":
        gpu = profile.gpu or "gpu"  # backends differ in what they report
    info = {"platform": f"{platform.system()}-{profile.arch or platform.machine()}",
            "cpu": profile.chip or platform.processor() or platform.machine() or "cpu",
            "gpu": gpu, "device": "gpu" if gpu else "cpu"}
    info["key"] = slug("_".join(x for x in (info["platform"], info["cpu"], gpu) if x), 96)
    return info


def machine_key() -> str:
    return machine_info()["key"]


def model_info(loaded) -> dict:
    """Key of a loaded model: its folder's name + a hash of its resolved path and config."""
    path = Path(loaded.path).resolve()
    config = json.dumps(loaded.config, sort_keys=True, default=str)
    config_hash = hashlib.sha256(config.encode()).hexdigest()[:12]
    path_hash = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return {"key": f"{slug(path.name)}-{path_hash}-{config_hash}", "name": loaded.name,
            "path": str(path), "config_hash": config_hash}


def tune_dir() -> Path:
    env = os.environ.get(DATA_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("mlxspec")) / "tune"


def result_path(loaded) -> Path:
    return tune_dir() / machine_key() / f"{model_info(loaded)['key']}.json"


def save_result(loaded, result: dict) -> Path:
    """Write ``result`` as the record of this machine and model; returns its path."""
    path = result_path(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(result, indent=2) + "\n")  # a reader never sees half a file
    return path


def save_cost(loaded, cost: CostModel) -> Path | None:
    """Store the verify-cost curve a run measured as this machine and model's record (``source``
    "run": no acceptance or depths, which `mlxspec tune` adds), unless a readable record is
    there already. None when it cannot be written: the next run measures again."""
    if load_result(loaded) is not None:
        return None
    record = {"version": FORMAT_VERSION, "source": "run",
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": dict(machine_info()), "model": model_info(loaded),
              "verify_cost": {str(n): round(c, 4) for n, c in sorted(cost.curve.items())}}
    if cost.partial:  # widths past the measured ones follow this measured slope
        record["verify_slope"] = round(cost.slope, 4)
    if cost.plain != 1.0:  # a pipelined plain token, in the curve's units
        record["plain_step"] = round(cost.plain, 4)
    if cost.context_known:
        record[CONTEXT_KEY] = cost.context_record()
    try:
        return save_result(loaded, record)
    except OSError:
        return None


def save_draft_cost(loaded, drafter: str, cost: float, draft=None) -> Path | None:
    """Add the cost of one ``drafter`` step that a run measured to this machine and model's
    record, where the record has none for it (a draft model's: when the record names no other
    draft model). None when there is no record or it already has one, or it cannot be written."""
    data = load_result(loaded)
    costs = data.get("draft_cost", {}) if data is not None else None
    if not isinstance(costs, dict) or drafter in costs:
        return None
    if drafter in MODEL_DRAFTERS:  # a cost that belongs to one draft model
        tuned = data.get("draft_model")
        if draft is None or (tuned and tuned.get("key") != model_info(draft)["key"]):
            return None
        data["draft_model"] = model_info(draft)
    data["draft_cost"] = {**costs, drafter: round(cost, 4)}
    try:
        return save_result(loaded, data)
    except OSError:
        return None


def save_tree_factor(loaded, factor: float) -> Path | None:
    """Add the tree-forward cost factor a run measured (engine.costs.measure_tree_factor) to
    this machine and model's record; None when there is no record or it cannot be written."""
    return _add_to_record(loaded, "tree_factor", round(factor, 4))


def _add_to_record(loaded, key: str, value) -> Path | None:
    """Set KEY of this machine and model's record to VALUE; None when there is no record or it
    cannot be written."""
    data = load_result(loaded)
    if data is None:
        return None
    data[key] = value
    try:
        return save_result(loaded, data)
    except OSError:
        return None


def load_result(loaded) -> dict | None:
    """The stored tune result for this machine and model, or None (also for an unreadable one)."""
    try:
        path = result_path(loaded)
        if not path.is_file():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            return None
        return data
    except (OSError, ValueError):
        return None


def stored_cost(loaded) -> CostModel | None:
    """The stored verify-cost curve as a measured :class:`CostModel`, or None."""
    data = load_result(loaded)
    try:
        curve = {int(n): float(c) for n, c in (data or {}).get("verify_cost", {}).items()}
    except (TypeError, ValueError, AttributeError):
        return None
    if not curve or 1 not in curve or any(c <= 0 for c in curve.values()):
        return None
    factor = (data or {}).get("tree_factor")
    factor = float(factor) if isinstance(factor, (int, float)) and factor > 0 else None
    cost = CostModel(curve=curve, measured=True, tree_factor=factor)
    slope = (data or {}).get("verify_slope")
    if isinstance(slope, (int, float)) and not isinstance(slope, bool) and 0 <= slope < 100:
        cost.slope, cost.partial = float(slope), True
    plain = (data or {}).get("plain_step")
    if isinstance(plain, (int, float)) and not isinstance(plain, bool) and 0 < plain <= 1:
        cost.plain = float(plain)
    read_context_cost(cost, (data or {}).get(CONTEXT_KEY))
    return cost


CONTEXT_KEY = "verify_cost_context"  # {"context": n, "at": {L: {n: cost}}, "plain_at": {L: cost}}


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e4


def read_context_cost(cost: CostModel, stored) -> None:
    """COST's context growth from a record's CONTEXT_KEY entry; an unreadable part is dropped
    (its costs then hold at every length), and ``cost.context_known`` says whether the record
    had the entry at all (a run measures it where it had not)."""
    if not isinstance(stored, dict):
        return
    cost.context_known = True
    try:
        context = int(stored.get("context", 0))
        at = {int(L): {int(n): float(c) for n, c in curve.items() if _positive(c)}
              for L, curve in (stored.get("at") or {}).items()}
        plain_at = {int(L): float(c) for L, c in (stored.get("plain_at") or {}).items() if _positive(c)}
    except (TypeError, ValueError, AttributeError):
        return
    at = {L: curve for L, curve in at.items() if L > context >= 1 and 1 in curve and len(curve) >= 2}
    cost.context, cost.at = context, at
    cost.plain_at = {L: c for L, c in plain_at.items() if L in at}


def save_context_cost(loaded, cost: CostModel) -> Path | None:
    """Add COST's context growth (measured by a run) to this machine and model's record; None
    when there is no record or it cannot be written (the next long request measures again)."""
    return _add_to_record(loaded, CONTEXT_KEY, cost.context_record())


def stored_draft_cost(loaded, drafter: str, draft=None) -> float | None:
    """The stored cost of one draft step of ``drafter``, or None. A draft model's cost only
    counts when it was tuned with this same draft model."""
    data = load_result(loaded) or {}
    if drafter in MODEL_DRAFTERS:  # a cost that belongs to one draft model
        tuned = data.get("draft_model") or {}
        if draft is None or tuned.get("key") != model_info(draft)["key"]:
            return None
    value = (data.get("draft_cost") or {}).get(drafter)
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None
