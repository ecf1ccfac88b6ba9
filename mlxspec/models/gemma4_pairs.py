"""Which checkpoints are Gemma-4 targets and assistants, and where a target's assistant lies,
from config.json alone (no mlx import: presets and the CLI ask before anything is loaded)."""

from __future__ import annotations

import json
from pathlib import Path

ASSISTANT_TYPES = ("gemma4_assistant",)
# a later layout: recognised so it is refused with a clear message, not as an unknown model
UNSUPPORTED_ASSISTANT_TYPES = ("gemma4_unified_assistant",)
TARGET_TYPES = ("gemma4", "gemma4_text")
ASSISTANT_SUFFIX = "-assistant"  # google/gemma-4-E4B-it -> google/gemma-4-E4B-it-assistant


def read_config(path: Path) -> dict | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_assistant_config(config: dict | None) -> bool:
    return bool(config) and config.get("model_type") in ASSISTANT_TYPES + UNSUPPORTED_ASSISTANT_TYPES


def is_assistant_folder(path: Path) -> bool:
    return is_assistant_config(read_config(path))


def is_gemma4_target(config: dict | None) -> bool:
    return bool(config) and config.get("model_type") in TARGET_TYPES
