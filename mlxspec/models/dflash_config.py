"""Telling a DFlash drafter's checkpoint apart by its config.json alone (no mlx import: the hub
and the CLI read it before any model is loaded)."""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURE = "DFlashDraftModel"


def is_dflash_config(cfg: dict) -> bool:
    archs = cfg.get("architectures") or []
    return ARCHITECTURE in archs or isinstance(cfg.get("dflash_config"), dict)


def is_dflash_folder(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and is_dflash_config(cfg)
