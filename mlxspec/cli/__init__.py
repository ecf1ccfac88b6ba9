"""The ``mlxspec`` command line: the app, the shared console helpers, one module per command
group (run and its chat, models and machine, bench, serve)."""

import os
import sys

from ..errors import MlxspecError
# each command module registers its commands on the app, in the order `--help` lists them
from . import run  # noqa: F401  isort: skip
from . import machine  # noqa: F401  isort: skip
from . import bench  # noqa: F401  isort: skip
from . import serve  # noqa: F401  isort: skip
from .app import app
from .console import DEBUG_ENV, DRAFTERS, print_error

__all__ = ["DRAFTERS", "app", "main"]


def main() -> None:
    """Console-script entry point: no tracebacks for anything the user can fix."""
    try:
        app(prog_name="mlxspec")
    except MlxspecError as err:
        print_error(str(err))
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:
        if os.environ.get(DEBUG_ENV):
            raise
        detail = " ".join(str(err).split())[:200]
        print_error(f"internal error: {type(err).__name__}: {detail} (set {DEBUG_ENV}=1 for the traceback)")
        sys.exit(1)
