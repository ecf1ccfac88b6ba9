"""Shared by the packaging tests: scripts/update_formula.py as a module, ruby, the formula path."""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORMULA = ROOT / "Formula" / "mlxspec.rb"

_spec = importlib.util.spec_from_file_location("update_formula", ROOT / "scripts" / "update_formula.py")
update_formula = importlib.util.module_from_spec(_spec)
sys.modules["update_formula"] = update_formula  # dataclasses look their module up there
_spec.loader.exec_module(update_formula)


def ruby() -> str:
    exe = shutil.which("ruby")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("ruby is missing: .ci/run installs Debian's ruby")
        pytest.skip("no ruby here (apt-get install ruby)")
    return exe


def file_name(url: str) -> str:
    return url.rsplit("/", 1)[1]
