"""The README and docs/ link to each other by relative path and heading anchor: none is broken
(scripts/check_links.py, which a planted broken link fails)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_links.py"), str(root)],
                          capture_output=True, text=True)


def test_no_broken_link_in_the_docs():
    result = check(ROOT)
    assert result.returncode == 0, result.stdout
    assert " 0 broken" in result.stdout


def test_a_broken_anchor_and_file_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#its-part) [bad](docs/a.md#nope) [gone](docs/b.md)\n")
    result = check(tmp_path)
    assert result.returncode == 1
    assert "2 broken" in result.stdout and "#nope" in result.stdout and "no file docs/b.md" in result.stdout
