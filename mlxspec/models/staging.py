"""Writing a model folder all or nothing: a conversion is staged beside its output and only
then renamed into place."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


@contextlib.contextmanager
def staged_folder(out: Path):
    """A fresh staging path beside OUT (not created: mlx-lm's convert creates it) that becomes
    OUT when the block ends well (an empty OUT, or one --force allows, is replaced) and is
    removed when it does not: an interrupted conversion leaves no half-written model."""
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)  # empty, or --force
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
