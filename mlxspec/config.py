"""User settings: environment variables first, then ``config.toml`` in the user config folder."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from . import options
from .errors import MlxspecError, UsageError

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


# -- effective settings: CLI flag > $MLXSPEC_* > config file > default -------------------

# name: (type, default, environment variable, place in the config file)
SETTINGS: dict[str, tuple[type, object, str, str]] = {
    "default_model": (str, None, DEFAULT_MODEL_ENV, "default_model"),
    "preset": (str, None, "MLXSPEC_PRESET", "preset"),
    "drafter": (str, "auto", "MLXSPEC_DRAFTER", "drafter"),
    "temp": (float, options.DEFAULT_TEMPERATURE, "MLXSPEC_TEMP", "sampling.temp"),
    "top_p": (float, options.DEFAULT_TOP_P, "MLXSPEC_TOP_P", "sampling.top_p"),
    "top_k": (int, options.DEFAULT_TOP_K, "MLXSPEC_TOP_K", "sampling.top_k"),
    "min_p": (float, options.DEFAULT_MIN_P, "MLXSPEC_MIN_P", "sampling.min_p"),
    "max_tokens": (int, options.DEFAULT_MAX_TOKENS, "MLXSPEC_MAX_TOKENS", "sampling.max_tokens"),
    "reasoning": (str, "auto", "MLXSPEC_REASONING", "reasoning"),
    "host": (str, options.DEFAULT_HOST, "MLXSPEC_HOST", "server.host"),
    "port": (int, options.DEFAULT_PORT, "MLXSPEC_PORT", "server.port"),
    "prompt_cache_bytes": (str, options.DEFAULT_PROMPT_CACHE_SIZE, "MLXSPEC_PROMPT_CACHE_BYTES",
                           "server.prompt_cache_bytes"),
}
# settings whose values mlxspec.options checks, by the option's name there
_OPTION_OF_SETTING = {"drafter": "drafter", "temp": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "min_p": "min_p", "max_tokens": "max_tokens", "reasoning": "reasoning"}
_SERVER_CHECKS = {  # the server's own settings: name: (ok, what it must be)
    "port": (lambda v: 1 <= v <= 65535, "between 1 and 65535"),
    "prompt_cache_bytes": (lambda v: _bytes_or_none(v) is not None, "a size such as 2GiB, 512MB or 0"),
}

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _bytes_or_none(text: str) -> int | None:
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text).lower())
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_bytes(text: str, what: str = "size") -> int:
    """'2GiB', '512MB', '1.5G', '0' -> bytes (K/M/G/T are powers of 1000, KiB... of 1024)."""
    value = _bytes_or_none(text)
    if value is None:
        raise UsageError(f"{what} must be a size such as 2GiB, 512MB or 0, got {text!r}")
    return value


def _typed(name: str, value, where: str, from_text: bool):
    """``value`` as the setting's type, or a one-line error naming the key and where it was."""
    kind = SETTINGS[name][0]
    try:
        if from_text:  # environment variables are strings
            value = value.strip()
            if kind is int:
                value = int(value)
            elif kind is float:
                value = float(value)
        elif kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError
    except ValueError:
        what = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise MlxspecError(f"{where} must be {what}, got {value!r}") from None
    option = _OPTION_OF_SETTING.get(name)
    if option is not None:
        options.check_values({option: value}, {option: where}, error=MlxspecError)
    check = _SERVER_CHECKS.get(name)
    if check and not check[0](value):
        raise MlxspecError(f"{where} must be {check[1]}, got {value!r}")
    return value


def _file_value(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def settings_with_sources(cli_values: dict | None = None) -> dict[str, tuple[object, str]]:
    """Every setting as (value, source), source one of flag, env, file, default.

    ``cli_values`` holds the flags given on the command line; None means not given."""
    cli_values = cli_values or {}
    path = user_config_path()
    data = read_user_config()
    out: dict[str, tuple[object, str]] = {}
    for name, (_, default, env, dotted) in SETTINGS.items():
        if cli_values.get(name) is not None:
            out[name] = (cli_values[name], "flag")  # flags are checked by the command itself
            continue
        text = os.environ.get(env, "")
        if text.strip():
            out[name] = (_typed(name, text, f"${env}", from_text=True), "env")
            continue
        value = _file_value(data, dotted)
        if value is not None:
            out[name] = (_typed(name, value, f"{dotted} in {path}", from_text=False), "file")
            continue
        out[name] = (default, "default")
    for name, value in cli_values.items():  # flags this table does not know pass through
        if name not in out and value is not None:
            out[name] = (value, "flag")
    return out


# tables of the config file whose keys are the user's own names
FREE_TABLES = ("aliases",)


def unknown_keys(data: dict) -> list[str]:
    """The dotted keys of a parsed config file that no setting reads (a typo, or an option's
    command-line name), in the file's order."""
    known = {dotted for *_, dotted in SETTINGS.values()}
    tables = {dotted.split(".")[0] for dotted in known if "." in dotted} | set(FREE_TABLES)
    out = []
    for key, value in data.items():
        if key in FREE_TABLES or (key in known and not isinstance(value, dict)):
            continue
        if key in tables and isinstance(value, dict):
            out += [f"{key}.{sub}" for sub in value if f"{key}.{sub}" not in known]
        else:
            out.append(key)
    return out


def _close_key(key: str) -> str | None:
    """The known key KEY was probably meant as: the same last part elsewhere, else a close spelling."""
    import difflib

    known = [dotted for *_, dotted in SETTINGS.values()]
    leaf = key.rsplit(".", 1)[-1].replace("-", "_")
    by_leaf = {dotted.rsplit(".", 1)[-1]: dotted for dotted in known}
    synonyms = {"temperature": "temp", "model": "default_model"}  # what mlx-lm users call them
    leaf = synonyms.get(leaf, leaf)
    if leaf in by_leaf:
        return by_leaf[leaf]
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    return by_leaf[close[0]] if close else None


def key_warnings() -> list[str]:
    """One warning line per key of the config file that no setting reads, with the key it was
    probably meant as. An unreadable file gives none: the commands that read it say why."""
    try:
        data = read_user_config()
    except MlxspecError:
        return []
    path = user_config_path()
    lines = []
    for key in unknown_keys(data):
        meant = _close_key(key)
        hint = f"; did you mean '{meant}'?" if meant and meant != key else ""
        lines.append(f"warning: unknown key '{key}' in {path} is ignored{hint}")
    return lines


def settings(cli_values: dict | None = None) -> dict:
    """The effective value of every setting (see :func:`settings_with_sources`)."""
    return {name: value for name, (value, _) in settings_with_sources(cli_values).items()}


def aliases() -> dict[str, str]:
    """``[aliases]`` from the config file: short name -> model folder or repo id."""
    table = read_user_config().get("aliases", {})
    if not isinstance(table, dict):
        raise MlxspecError(f"aliases in {user_config_path()} must be a table of name = \"model\"")
    for name, ref in table.items():
        if not isinstance(ref, str) or not ref.strip():
            raise MlxspecError(f"aliases.{name} in {user_config_path()} must be a model path or repo id")
    return dict(table)
