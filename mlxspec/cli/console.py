"""What every command shares: the console, one-line notes and errors, user-error handling,
help text, loading a model, stats output, shell completion."""

import contextlib
import functools
import os
import sys
from pathlib import Path

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


def complete_removable(incomplete: str) -> list[str]:
    """Shell completion for `rm`'s MODEL: what complete_model offers, then the GGUF
    conversions: their listed names and their `ollama:` / `lmstudio:` sources."""
    try:
        from ..models.gguf_cache import list_conversions

        names = [name for c in list_conversions() for name in
                 (c.name, *(s for s in c.sources if s.startswith(("ollama:", "lmstudio:"))))]
    except Exception:
        names = []
    found = complete_model(incomplete)
    return found + [n for n in dict.fromkeys(names) if n not in found and n.lower().startswith(incomplete.lower())]


# what each drafter is, in the help of every command taking --drafter (keys: options.DRAFTERS)
DRAFTER_HELP = {
    "auto": "a --draft-model if given, else a DFlash drafter or Gemma-4 assistant found beside MODEL, "
            "else MODEL's own MTP head if it has one, else prompt lookup; or the drafter `mlxspec tune` "
            "rated fastest",
    "pld": "prompt lookup",
    "draft": "a draft model sharing MODEL's tokenizer, needs --draft-model",
    "mtp": "MODEL's native multi-token-prediction head",
    "assistant": "a Gemma-4 target's assistant drafter: --draft-model, or <MODEL>-assistant beside it",
    "dflash": "a DFlash block drafter made for MODEL: a block of drafts per forward from MODEL's own "
              "features; --draft-model, or <MODEL>-DFlash* beside it or in the Hugging Face cache",
    "none": "plain decoding",
}


def drafters_help() -> str:
    """Every drafter with what it is, as one sentence for --help."""
    parts = [f"{name} ({DRAFTER_HELP[name]})" for name in DRAFTERS]
    return ", ".join(parts[:-1]) + " or " + parts[-1] + "."


def presets_help(**notes: str) -> str:
    """The preset names for --help, each with its NOTES if any: "auto, ..., dflash (...) or off"."""
    from ..presets import PRESETS

    notes = {"dflash": "a DFlash drafter made for MODEL", **notes}
    names = [f"{name} ({notes[name]})" if name in notes else name for name in PRESETS]
    return ", ".join(names[:-1]) + " or " + names[-1]


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


class ErrorLines:
    """A stderr that passes on only the CLI's error lines, each marked with its rank: what a
    follower of a sharded run (mlx.launch) shows, where rank 0 alone prints."""

    def __init__(self, stream, rank: int):
        self.stream, self.rank = stream, rank

    def write(self, text: str) -> int:
        if text.startswith("error:"):
            self.stream.write(f"error: rank {self.rank}:{text[len('error:'):]}")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:  # no colours, spinners or live displays
        return False


def quiet_rank(rank: int) -> None:
    """Rank RANK (not 0) of a sharded run: no output, no notes, no progress; its errors alone
    (everything with MLXSPEC_DEBUG set, tracebacks included)."""
    sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if not os.environ.get(DEBUG_ENV):
        sys.stderr = ErrorLines(sys.stderr, rank)


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
               "meaningful. For a real one in one command: `mlxspec run qwen3-0.6b --yes` (downloads it "
               "once); or run a GGUF you already have: `mlxspec run FILE.gguf`, `mlxspec list --ollama`. "
               "MLXSPEC_DEFAULT_MODEL sets the default.")


# -- generation --------------------------------------------------------------


@functools.cache
def stdout_console():
    from rich.console import Console

    return Console(highlight=False)  # writes to whatever sys.stdout is at the time


@functools.cache
def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def quiet_libraries() -> None:
    """Keep third-party warnings off stderr (transformers' notes on rope_parameters, "Token
    indices sequence length ..."): mlxspec says what matters in its own lines. $MLXSPEC_DEBUG
    keeps them."""
    if os.environ.get(DEBUG_ENV):
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is imported
    with contextlib.suppress(Exception):
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()  # already imported (the API, the tests)


@contextlib.contextmanager
def model_errors(model, draft_model=None):
    """A model or draft model that names nothing fails with one line saying which, the cached
    model it is closest to, and how to download it (:func:`missing_model_message`)."""
    from ..errors import ModelNotFoundError

    try:
        yield
    except ModelNotFoundError as err:
        text = str(err)
        what, ref = ("draft model", draft_model) if text.startswith("draft model") else ("model", model)
        better = missing_model_message(ref, what) if ref is not None else None
        if better is None:
            raise
        raise ModelNotFoundError(better) from None


def missing_model_message(ref: str, what: str = "model") -> str | None:
    """One line for a REF (a MODEL or --draft-model, named WHAT) that names no model: it is not
    found, the cached model or folder it is closest to, and how to download it. None when REF
    names a model after all (it failed for another reason)."""
    import difflib

    from ..errors import ModelNotFoundError
    from ..models.loader import display_path, gguf_source, hf_cache_dir, is_model_ref

    ref = ref.strip()
    if not ref or is_model_ref(ref):
        return None
    try:
        gguf_source(ref)
    except ModelNotFoundError as err:  # a GGUF file or an Ollama / LM Studio name
        return str(err)
    path = Path(ref).expanduser()
    if ref.startswith(("/", ".", "~")) or ref.count("/") > 1:  # a folder, as the loader reads it
        siblings = [p.name for p in path.parent.iterdir() if p.is_dir()] if path.parent.is_dir() else []
        close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
        meant = f"; did you mean '{ref[: len(ref) - len(path.name)]}{close[0]}'?" if close else ""
        return f"{what} folder '{ref}' does not exist{meant}"
    from ..hub import cached_repo_ids

    names = cached_repo_ids()
    close = difflib.get_close_matches(ref, names, n=1, cutoff=0.75)
    close = close or [n for n in names if n.lower() == ref.lower()]
    meant = f"; did you mean '{close[0]}' (cached)?" if close else ""
    return (f"{what} '{ref}' not found: it is not a local folder and not in the Hugging Face cache "
            f"({display_path(hf_cache_dir())}){meant}; to download it: `mlxspec pull {ref}`")


def load_with_spinner(model, draft_model=None, prompt_cache_bytes: int | None = None):
    """``mlxspec.api.load(model, draft_model)`` under a "loading model…" spinner on a terminal
    (nothing when stderr is piped: no escape codes in logs); PROMPT_CACHE_BYTES sizes the
    prompt cache (None: the API's default)."""
    from ..api import load

    quiet_libraries()
    sized = {} if prompt_cache_bytes is None else {"prompt_cache_bytes": prompt_cache_bytes}
    console = stderr_console()
    with model_errors(model, draft_model):
        with console.status("loading model…", spinner="dots") if console.is_terminal else contextlib.nullcontext():
            return load(model, draft_model=draft_model, **sized)


def valid_text(text: str) -> tuple[str, bool]:
    """TEXT with what was not UTF-8 (undecodable bytes: lone surrogates, as Python hands over
    argv and input()) replaced by U+FFFD; and whether anything was."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that stands for no byte
            raw = text.encode("utf-8", "replace")
        return raw.decode("utf-8", "replace"), True


def replaced_note(what: str) -> str:
    """The one line saying that WHAT (stdin, the prompt argument...) was not UTF-8."""
    return f"note: {what} is not valid UTF-8; the bytes that are not were replaced with U+FFFD"


def print_stats(stats, table: bool) -> None:
    from rich.text import Text

    from ..ui import stats_line, stats_table

    if stats is None:
        return
    if table:
        stderr_console().print(stats_table(stats))
    else:  # soft_wrap: one line however narrow the terminal
        stderr_console().print(Text(stats_line(stats), style="dim"), soft_wrap=True)


@contextlib.contextmanager
def progress(label: str):
    """on_step(message, done, total): a progress bar on a terminal, else a line per phase."""
    console = stderr_console()
    if not console.is_terminal:
        last = {"phase": None}

        def on_step(message, done, total):
            phase = message.split(":")[0]
            if phase != last["phase"]:
                last["phase"] = phase
                print_note(f"{label}: {phase}")

        yield on_step
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(label, total=None)
        yield lambda message, done, total: progress.update(task, description=message,
                                                           completed=done, total=total)
