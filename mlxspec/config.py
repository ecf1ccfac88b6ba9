"""User settings: environment variables first, then ``config.toml`` in the user config folder."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from .errors import MlxspecError

DEFAULT_MODEL_ENV = "MLXSPEC_DEFAULT_MODEL"


def user_config_path() -> Path:
    """``<user config dir>/mlxspec/config.toml`` (e.g. ~/.config/mlxspec/config.toml on Linux)."""
    from platformdirs import user_config_dir

    return Path(user_config_dir("mlxspec")) / "config.toml"


def read_user_config() -> dict:
    """The parsed config file, or ``{}`` when there is none."""
    path = user_config_path()
    if not path.is_file():
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise MlxspecError(f"cannot read the config file {path}: {err}") from None


def default_model() -> str | None:
    """The model to use when none is named: $MLXSPEC_DEFAULT_MODEL, then ``default_model``."""
    env = os.environ.get(DEFAULT_MODEL_ENV, "").strip()
    if env:
        return env
    value = read_user_config().get("default_model")
    if value is not None and not isinstance(value, str):
        raise MlxspecError(f"default_model in {user_config_path()} must be a string")
    return value or None
