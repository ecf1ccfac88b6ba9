"""The one Typer app every command registers on, and its root options (--version)."""

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from .. import __version__

app = typer.Typer(
    name="mlxspec",
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
        "--version", callback=_print_version, is_eager=True,
        help="Print the mlxspec, mlx and mlx-lm versions and exit.")] = False,
) -> None:
    """Exact speculative decoding for MLX: faster generation with identical output."""
