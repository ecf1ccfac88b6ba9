"""Writing all or nothing: a conversion is staged beside its output folder and only then
renamed into place; a small file likewise (:func:`write_whole`)."""

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


def write_whole(path: Path, text: str) -> None:
    """Write TEXT to PATH whole or not at all: a temporary file beside it, renamed over it, so
    a reader never sees half a file; on failure the temporary file is removed and the error
    raised."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
