"""The ``mlxspec`` command line: the app, the shared console helpers, one module per command
group (run and its chat, models, machine, bench, serve)."""

import os
import sys

from ..errors import MlxspecError

# each command module registers its commands on the app, in the order `--help` lists them
from . import run  # isort: skip
from . import models  # isort: skip
from . import machine  # isort: skip
from . import bench  # isort: skip
from . import serve  # isort: skip
from ..models.sharding import launch_rank
from ..options import DRAFTERS
from .app import app
from .console import DEBUG_ENV, print_error, quiet_rank

COMMAND_MODULES = (run, models, machine, bench, serve)  # imported for their commands, in --help's order
__all__ = ["DRAFTERS", "app", "main"]
# commands that would serve, time or measure the model apart on every rank of an mlx.launch run
# (each rank its own server, its own timings: the ranks' collectives would wait on each other);
# `bench --real-shapes --sharded` is the benchmark made for it
# `serve` shards: rank 0 serves, the others run its generations with it (server/sharded.py)
UNSHARDED_COMMANDS = ("bench", "tune", "profile")


def main() -> None:
    """Console-script entry point: no tracebacks for anything the user can fix."""
    rank = launch_rank()
    if rank:  # a follower of a sharded run (mlx.launch): rank 0 alone prints
        quiet_rank(rank)
    if rank is not None:
        command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
        if command in UNSHARDED_COMMANDS and not (command == "bench" and "--sharded" in sys.argv):
            print_error(f"`mlxspec {command}` does not run under mlx.launch: only `mlxspec run` and `mlxspec serve` "
                        "shard a model (docs/distributed.md)")
            sys.exit(2)
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
