"""What every command shares: the console, one-line notes and errors, user-error handling,
help text, loading a model, stats output, shell completion."""

import contextlib
import functools
import os
import sys

import typer

from ..errors import MlxspecError
from ..options import DRAFTERS, REASONING_MODES, check_choice

DEBUG_ENV = "MLXSPEC_DEBUG"


# -- small helpers -----------------------------------------------------------


def complete_model(incomplete: str) -> list[str]:
    """Shell completion for MODEL: cached repo ids, then catalog aliases.

    Paths are left to the shell (nothing matches "./" here, so its file completion takes over).
    A broken or missing cache completes nothing rather than printing a traceback into the shell.
    """
    try:
        from .. import hub

        names = [row["repo_id"] for row in hub.list_models()]
        names += [entry.alias for entry in hub.catalog().values()]
    except Exception:
        return []
    return [name for name in dict.fromkeys(names) if name.lower().startswith(incomplete.lower())]


def complete_drafter(incomplete: str) -> list[str]:
    return [name for name in DRAFTERS if name.startswith(incomplete)]


def complete_reasoning(incomplete: str) -> list[str]:
    return [mode for mode in REASONING_MODES if mode.startswith(incomplete)]


def help_text(text: str) -> str:
    """Command help written as indented paragraphs -> one line per paragraph, for Typer."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in text.strip().split("\n\n"))


def no_color() -> bool:
    """NO_COLOR set and not empty (no-color.org): no ANSI colours anywhere. Rich reads it itself."""
    return bool(os.environ.get("NO_COLOR"))


def print_error(message: str) -> None:
    color = sys.stderr.isatty() and not no_color()
    label = "\x1b[1;31merror:\x1b[0m" if color else "error:"
    sys.stderr.write(f"{label} {message}\n")
    sys.stderr.flush()


def print_note(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def user_errors():
    """MlxspecError -> one line on stderr and its exit code; Ctrl-C -> exit 130 quietly."""
    try:
        yield
    except MlxspecError as err:
        print_error(str(err))
        raise typer.Exit(err.exit_code)
    except KeyboardInterrupt:
        print_note("")
        raise typer.Exit(130)


def check_reasoning(mode) -> None:
    check_choice("--reasoning", mode, REASONING_MODES)


def demo_notice(name: str) -> None:
    print_note(f"note: using '{name}', a small built-in demo model: fast, but its answers are not "
          "meaningful. Use a real model with `mlxspec run <folder-or-repo-id> ...` "
          "or set MLXSPEC_DEFAULT_MODEL.")


# -- generation --------------------------------------------------------------


@functools.cache
def stdout_console():
    from rich.console import Console

    return Console(highlight=False)  # writes to whatever sys.stdout is at the time


@functools.cache
def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def load_with_spinner(model, draft_model=None, prompt_cache_bytes: int | None = None):
    """``mlxspec.api.load(model, draft_model)`` under a "loading model…" spinner on a terminal
    (nothing when stderr is piped: no escape codes in logs); PROMPT_CACHE_BYTES sizes the
    prompt cache (None: the API's default)."""
    from ..api import load

    sized = {} if prompt_cache_bytes is None else {"prompt_cache_bytes": prompt_cache_bytes}
    console = stderr_console()
    with console.status("loading model…", spinner="dots") if console.is_terminal else contextlib.nullcontext():
        return load(model, draft_model=draft_model, **sized)


def print_stats(stats, table: bool) -> None:
    from rich.text import Text

    from ..ui import stats_line, stats_table

    if stats is None:
        return
    if table:
        stderr_console().print(stats_table(stats))
    else:  # soft_wrap: one line however narrow the terminal
        stderr_console().print(Text(stats_line(stats), style="dim"), soft_wrap=True)


