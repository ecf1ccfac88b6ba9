"""Release packaging: the Homebrew formula, one version, the documented install paths.

The formula is loaded by tests/formula_harness.rb (Debian's ruby, installed by .ci/run): its
metadata is checked against pyproject.toml, its install method runs against a recording
virtualenv, and its test block runs against the real ``mlxspec`` of this checkout.
"""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

import mlxspec
from formula_helpers import FORMULA, ROOT, file_name, ruby, update_formula

HARNESS = Path(__file__).with_name("formula_harness.rb")


@pytest.fixture
def mlxspec_bin(tmp_path):
    """A bin/ holding `mlxspec`, this checkout's command line, as Homebrew's bin would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "mlxspec"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m mlxspec "$@"\n')
    exe.chmod(0o755)
    return bin_dir


def harness(action, bin_dir=None, formula=FORMULA):
    env = dict(os.environ, HARNESS_BIN=str(bin_dir or "/nonexistent"), HF_HUB_OFFLINE="1")
    return subprocess.run([ruby(), str(HARNESS), str(formula), action], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def described():
    proc = harness("describe")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def runtime_requirements(python="3.13"):
    """pyproject's runtime requirements that apply on the formula's target: macOS arm64."""
    env = dict(update_formula.target_environment(python), extra="")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


# -- the formula ---------------------------------------------------------------------------------


def test_formula_parses_with_ruby():
    proc = subprocess.run([ruby(), "-c", str(FORMULA)], capture_output=True, text=True)
    assert proc.returncode == 0 and "Syntax OK" in proc.stdout, proc.stderr


def test_formula_is_a_virtualenv_python_app_for_apple_silicon(described):
    assert described["class"] == "Mlxspec" and described["virtualenv"]
    assert described["install_defined"] and described["test_block_defined"]
    deps = described["depends_on"]
    assert "macos" in deps and {"arch": "arm64"} in deps
    pythons = [d for d in deps if isinstance(d, str) and d.startswith("python@")]
    assert pythons in (["python@3.12"], ["python@3.13"])
    assert described["license"] == "MIT" and described["homepage"].startswith("https://")
    desc = described["desc"]  # brew audit: at most 80 characters, no name, no final full stop
    assert 0 < len(desc) <= 80 and not desc.lower().startswith("mlxspec") and not desc.endswith(".")
    text = FORMULA.read_text()
    assert "include Language::Python::Virtualenv" in text and "virtualenv_install_with_resources" in text


def test_formula_version_is_the_package_version(described):
    assert described["version"] == mlxspec.__version__
    assert file_name(described["url"]) == f"mlxspec-{mlxspec.__version__}.tar.gz"
    assert re.fullmatch(r"[0-9a-f]{64}", described["sha256"])
    assert set(described["sha256"]) != {"0"}


def test_every_runtime_dependency_has_a_resource(described):
    resources = {r["name"]: r for r in described["resources"]}
    reqs = runtime_requirements()
    assert {"mlx", "mlx-lm", "transformers", "typer", "fastapi"} <= {canonicalize_name(r.name) for r in reqs}
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in resources, f"{name} has no resource: run scripts/update_formula.py"
        filename = file_name(resources[name]["url"])
        version = (parse_wheel_filename(filename) if filename.endswith(".whl")
                   else parse_sdist_filename(filename))[1]
        assert req.specifier.contains(version, prereleases=True), f"{name} {version} does not satisfy {req}"
    # and what the dependencies need on a Mac: mlx's Metal library, huggingface-hub's xet client
    assert {"mlx-metal", "numpy", "huggingface-hub", "tokenizers"} <= resources.keys()
    assert "mlxspec" not in resources


def test_resources_are_pinned_files_the_target_can_install(described):
    python = update_formula.formula_python(FORMULA.read_text())
    tags = set(update_formula.target_tags(python))
    names = [r["name"] for r in described["resources"]]
    assert names == sorted(names) and len(names) == len(set(names))
    for r in described["resources"]:
        assert r["url"].startswith("https://files.pythonhosted.org/packages/"), r
        assert re.fullmatch(r"[0-9a-f]{64}", r["sha256"]), r
        filename = file_name(r["url"])
        if filename.endswith(".whl"):
            project, _, _, wheel_tags = parse_wheel_filename(filename)
            assert r["using"] == "nounzip", f"{r['name']}: a wheel must be staged as a file"
            assert wheel_tags & tags, f"{filename} does not install on macOS 14 arm64 with Python {python}"
        else:
            assert filename.endswith(".tar.gz") and r["using"] is None, r
            project = parse_sdist_filename(filename)[0]
        assert canonicalize_name(project) == r["name"], r


def test_install_puts_every_resource_in_the_venv_once_and_completions(mlxspec_bin):
    proc = harness("install", mlxspec_bin)
    assert proc.returncode == 0, proc.stderr
    log = json.loads(proc.stdout)
    described = json.loads(harness("describe").stdout)
    by_name = {r["name"]: r for r in described["resources"]}
    via_venv = [e["resource"] for e in log if e["call"] == "pip_install_resource"]
    wheel_files = [e for e in log if e["call"] == "pip_install"]
    for entry in wheel_files:  # staged file, under the wheel's own name (pip parses it)
        assert entry["exists"] and entry["basename"].endswith(".whl"), entry
    installed = via_venv + [canonicalize_name(parse_wheel_filename(e["basename"])[0]) for e in wheel_files]
    assert sorted(installed) == sorted(by_name)  # each exactly once
    for name in via_venv:
        assert not by_name[name]["url"].endswith(".whl")
    shells = {e["shell"]: e["script"] for e in log if e["call"] == "completion"}
    assert set(shells) == {"bash", "zsh", "fish", "pwsh"}
    assert "_MLXSPEC_COMPLETE" in shells["bash"] and "compdef mlxspec" in shells["zsh"]


def test_formula_test_block_runs_the_real_commands(mlxspec_bin):
    proc = harness("test", mlxspec_bin)
    assert proc.returncode == 0, proc.stderr
    checks = [e for e in json.loads(proc.stdout) if e["call"] == "assert"]
    assert len(checks) >= 3 and all(c["ok"] for c in checks)
    block = FORMULA.read_text().split("  test do", 1)[1]
    assert '"#{bin}/mlxspec --version"' in block and '"#{bin}/mlxspec profile --json"' in block


def test_formula_test_block_fails_on_a_wrong_version(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mlxspec").write_text('#!/bin/sh\necho "mlxspec 9.9.9"\n')
    (bin_dir / "mlxspec").chmod(0o755)
    proc = harness("test", bin_dir)
    assert proc.returncode == 1 and "9.9.9" in proc.stderr


def test_formula_url_is_one_brew_audit_accepts(described):
    """brew audit --strict refuses PyPI's unhashed /packages/source/ address, git urls and
    branches: the url is a versioned tarball, the release's sdist."""
    url = described["url"]
    assert update_formula.audit_url(url) is None, url
    assert "/packages/source/" not in url and not url.endswith(".git") and "/heads/" not in url
    version = mlxspec.__version__
    assert (url.startswith("https://files.pythonhosted.org/packages/")
            or re.fullmatch(rf"https://github\.com/[^/]+/mlxspec/releases/download/v{re.escape(version)}/"
                            rf"mlxspec-{re.escape(version)}\.tar\.gz", url)), url
    # the homepage is the repository, not a PyPI page that does not exist yet
    assert described["homepage"].startswith("https://github.com/")


def test_formula_caveats_name_the_services_default_model(described):
    from mlxspec.options import DEFAULT_PORT

    caveats = described["caveats"]
    assert caveats, "the formula has no caveats"
    flat = " ".join(caveats.split())
    for words in ("brew services start mlxspec", "mlxspec serve", f"127.0.0.1:{DEFAULT_PORT}", "demo model",
                  'default_model = "qwen3-0.6b"', "mlxspec pull qwen3-0.6b", "mlxspec config path",
                  "brew services restart mlxspec", "/log/mlxspec.log"):
        assert words in flat, words
    # the model the caveats suggest is a catalog alias, and default_model is the config key
    catalog = json.loads((ROOT / "mlxspec" / "catalog.json").read_text())
    assert "qwen3-0.6b" in json.dumps(catalog)
    from mlxspec.config import SETTINGS

    assert SETTINGS["default_model"][3] == "default_model" and SETTINGS["port"][3] == "server.port"


def test_formula_resources_reads_what_ruby_reads(described):
    parsed = update_formula.formula_resources(FORMULA.read_text())
    assert parsed == [(r["name"], r["url"], r["sha256"]) for r in described["resources"]]


# -- one version, docs ---------------------------------------------------------------------------


def test_version_has_one_source():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["hatch"]["version"]["path"] == "mlxspec/__init__.py"
    literal = re.compile(r"""(?:__version__|version)\s*=\s*["']\d+\.\d+\.\d+["']""")
    for path in (ROOT / "mlxspec").rglob("*.py"):
        if path.name != "__init__.py" or path.parent.name != "mlxspec":
            assert not literal.search(path.read_text(encoding="utf-8")), path
    changelog = (ROOT / "docs" / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[?([^\]\s]+)", changelog, re.M)
    released = [h for h in headings if h.lower() != "unreleased"]
    assert released and released[0] == mlxspec.__version__, headings
    assert headings.index(released[0]) <= 1  # at most an [Unreleased] section above it


def install_table(readme: str) -> list[str]:
    """The rows of the README's install table."""
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_install_paths_are_documented():
    readme = (ROOT / "README.md").read_text()
    for command in ("brew tap", "brew install", "pip install .", "pipx install /path/to/checkout",
                    "uv tool install .", '".[cuda]"', "--install-completion"):
        assert command in readme, command
    # not on PyPI yet: every row installs from a checkout (Homebrew: once a release exists)
    rows = install_table(readme)
    assert len(rows) >= 4
    for row in rows:
        assert "from a checkout" in row or "once a release exists" in row, row
        for by_name in ("pipx install mlxspec", "uv tool install mlxspec", 'install "mlxspec['):
            assert by_name not in row, row
    checklist = (ROOT / "docs" / "releasing.md").read_text()
    assert "scripts/update_formula.py" in checklist and "CHANGELOG" in checklist


def test_the_wheel_holds_the_product_only(tmp_path):
    """Built from this tree, the wheel has the package and its assets, and none of the test
    checkpoint builders nor the training-only GatedDeltaNet backward (they live in tests/)."""
    import zipfile

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(root)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("mlxspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mlxspec/engine/speculate.py" in names and "mlxspec/assets/demo/model.safetensors" in names
    assert "mlxspec/bench/workloads/echo.jsonl" in names  # `mlxspec bench` without a checkout
    assert {f"mlxspec/server/static/{f}" for f in ("index.html", "chat.js", "chat.css")} <= set(names)  # the chat page
    assert not [n for n in names if n.startswith("tests/") or n.split("/")[-1] in ("tiny.py", "tiny_mtp.py",
                                                                                  "conftest.py", "gdn_grad.py")]
