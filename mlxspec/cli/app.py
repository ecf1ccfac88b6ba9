"""The one Typer app every command registers on, its root options (--version / -V), and how
it reports a usage error (one ``error:`` line) and a mistyped config key (one warning)."""

import contextlib
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer
from typer.core import TyperGroup, TyperOption

from .. import __version__
from .console import print_error, print_note

# click's UsageError (a bad value, an unknown option or command), from whichever copy of click
# Typer uses: BadParameter derives from it
CLICK_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


@contextlib.contextmanager
def _one_line_usage_errors(ctx=None):
    """Click's usage errors as one ``error:`` line and exit code 2, not a usage box. The error
    that prints --help (a group run without arguments) goes its own way."""
    try:
        yield
    except CLICK_USAGE_ERROR as err:
        if type(err).__name__ == "NoArgsIsHelpError":
            raise
        context = getattr(err, "ctx", None) or ctx
        message = " ".join(err.format_message().split())
        message = message[:1].lower() + message[1:]
        where = f" (see `{context.command_path} --help`)" if context is not None else ""
        print_error(f"{message.rstrip('.')}{where}")
        raise typer.Exit(err.exit_code) from None


class OneLineErrorGroup(TyperGroup):
    """The root command: its own usage errors and those of every command under it (they are
    parsed inside its invoke) come out as one line."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with _one_line_usage_errors(ctx):
            return super().invoke(ctx)


def _no_type_for_flags() -> None:
    """Typer's help shows a type beside each option; for on/off flags it is "<bool>", which
    says nothing: show none (Typer versions without the column are left alone)."""
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_blank", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich.flags_blank = True
    TyperOption.display_type_rich = display_type_rich


_no_type_for_flags()

app = typer.Typer(
    name="mlxspec",
    cls=OneLineErrorGroup,
    help="Exact speculative decoding for MLX: faster generation with identical output.",
    add_completion=True,  # --install-completion / --show-completion (Homebrew calls the latter)
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # main() prints one-line errors instead
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _dist_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"mlxspec {__version__} (mlx {_dist_version('mlx')}, mlx-lm {_dist_version('mlx-lm')})")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_print_version, is_eager=True,
        help="Print the mlxspec, mlx and mlx-lm versions and exit.")] = False,
) -> None:
    """Exact speculative decoding for MLX: faster generation with identical output."""
    from ..config import key_warnings

    for line in key_warnings():  # a mistyped key in config.toml is named, whatever the command
        print_note(line)
