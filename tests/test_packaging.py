"""Release packaging: the Homebrew formula, scripts/update_formula.py, one version, completion,
NO_COLOR.

The formula is loaded by tests/formula_harness.rb (Debian's ruby, installed by .ci/run): its
metadata is checked against pyproject.toml, its install method runs against a recording
virtualenv, and its test block runs against the real ``mlxspec`` of this checkout.
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

import mlxspec

ROOT = Path(__file__).resolve().parents[1]
FORMULA = ROOT / "Formula" / "mlxspec.rb"
HARNESS = Path(__file__).with_name("formula_harness.rb")

spec = importlib.util.spec_from_file_location("update_formula", ROOT / "scripts" / "update_formula.py")
update_formula = importlib.util.module_from_spec(spec)
sys.modules["update_formula"] = update_formula  # dataclasses look their module up there
spec.loader.exec_module(update_formula)


def _ruby() -> str:
    ruby = shutil.which("ruby")
    if ruby is None:
        if os.environ.get("CI"):
            pytest.fail("ruby is missing: .ci/run installs Debian's ruby")
        pytest.skip("no ruby here (apt-get install ruby)")
    return ruby


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
    return subprocess.run([_ruby(), str(HARNESS), str(formula), action], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def described():
    proc = harness("describe")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def file_name(url):
    return url.rsplit("/", 1)[1]


def runtime_requirements(python="3.13"):
    """pyproject's runtime requirements that apply on the formula's target: macOS arm64."""
    env = default_environment()
    env.update(sys_platform="darwin", platform_system="Darwin", platform_machine="arm64",
               os_name="posix", python_version=python, implementation_name="cpython")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


# -- the formula ---------------------------------------------------------------------------------


def test_formula_parses_with_ruby():
    proc = subprocess.run([_ruby(), "-c", str(FORMULA)], capture_output=True, text=True)
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


# -- scripts/update_formula.py -------------------------------------------------------------------

TAGS = update_formula.target_tags("3.13")


def pypi_file(filename, yanked=False):
    sha = hashlib.sha256(filename.encode()).hexdigest()
    return {"filename": filename, "url": f"https://files.pythonhosted.org/packages/aa/bb/{filename}",
            "hashes": {"sha256": sha}, "yanked": yanked}


def test_choose_file_compiled_gets_the_oldest_fitting_macos_wheel():
    files = [pypi_file(f) for f in (
        "mlx-0.32.4-cp313-cp313-macosx_26_0_arm64.whl", "mlx-0.32.4-cp313-cp313-macosx_15_0_arm64.whl",
        "mlx-0.32.4-cp313-cp313-macosx_14_0_arm64.whl", "mlx-0.32.4-cp312-cp312-macosx_14_0_arm64.whl",
        "mlx-0.32.4-cp313-cp313t-macosx_14_0_arm64.whl", "mlx-0.32.4-cp313-cp313-manylinux_2_35_x86_64.whl",
        "mlx-0.32.3-cp313-cp313-macosx_14_0_arm64.whl")]
    chosen = update_formula.choose_file("mlx", "0.32.4", files, TAGS)
    assert file_name(chosen.url) == "mlx-0.32.4-cp313-cp313-macosx_14_0_arm64.whl" and chosen.is_wheel
    assert chosen.sha256 == files[2]["hashes"]["sha256"]
    abi3 = [pypi_file("tokenizers-0.23.3-cp310-abi3-macosx_11_0_arm64.whl"), pypi_file("tokenizers-0.23.3.tar.gz")]
    assert file_name(update_formula.choose_file("tokenizers", "0.23.3", abi3, TAGS).url).endswith("abi3-macosx_11_0_arm64.whl")


def test_choose_file_pure_python_gets_its_wheel_and_sdist_only_without_one():
    files = [pypi_file("Typer-0.29.2-py3-none-any.whl"), pypi_file("typer-0.29.2.tar.gz")]
    chosen = update_formula.choose_file("typer", "0.29.2", files, TAGS)
    assert file_name(chosen.url) == "Typer-0.29.2-py3-none-any.whl" and chosen.is_wheel
    assert "using: :nounzip" in chosen.ruby()
    # no wheel published (or only yanked ones): the sdist
    sdist_only = update_formula.choose_file("typer", "0.29.2", files[1:], TAGS)
    assert not sdist_only.is_wheel and "nounzip" not in sdist_only.ruby()
    yanked = [pypi_file("typer-0.29.2-py3-none-any.whl", yanked=True), files[1]]
    assert not update_formula.choose_file("typer", "0.29.2", yanked, TAGS).is_wheel
    with pytest.raises(update_formula.FormulaError, match="neither an sdist nor a wheel"):
        update_formula.choose_file("typer", "0.30.0", files, TAGS)
    with pytest.raises(update_formula.FormulaError):  # linux-only wheels do not count
        update_formula.choose_file("x", "1.0", [pypi_file("x-1.0-cp313-cp313-manylinux_2_17_x86_64.whl")], TAGS)


def test_rewrite_replaces_url_sha_and_resources():
    text = FORMULA.read_text()
    resources = [update_formula.Resource("zeta", "1.0", "https://files.pythonhosted.org/packages/z/zeta-1.0.tar.gz", "1" * 64),
                 update_formula.Resource("alpha", "2.0", "https://files.pythonhosted.org/packages/a/alpha-2.0-cp313-cp313-macosx_14_0_arm64.whl", "2" * 64)]
    new = update_formula.rewrite(text, "https://example.invalid/mlxspec-9.0.tar.gz", "f" * 64, resources)
    assert new.count("  resource ") == 2 and new.index('resource "alpha"') < new.index('resource "zeta"')
    assert 'url "https://example.invalid/mlxspec-9.0.tar.gz"\n  sha256 "' + "f" * 64 in new
    assert "alpha-2.0-cp313-cp313-macosx_14_0_arm64.whl\", using: :nounzip" in new
    assert new.split("  resource ")[0].count('depends_on "python@') == 1  # the rest is kept
    assert update_formula.rewrite(new, "https://example.invalid/mlxspec-9.0.tar.gz", "f" * 64, resources) == new
    assert text.split("  def install", 1)[1] == new.split("  def install", 1)[1]
    with pytest.raises(update_formula.FormulaError):
        update_formula.rewrite("class X < Formula\nend\n", "u", "s", resources)


def test_resolve_reads_uv_pins(monkeypatch):
    seen = {}

    def fake_run(args, **kwargs):
        seen["args"], seen["env"] = args, kwargs["env"]
        return "Jinja2==3.1.6\n    # via mlx-lm\nmlx-metal==0.32.4\nuvicorn[standard]==0.54.0\n"

    monkeypatch.setattr(update_formula, "_run", fake_run)
    monkeypatch.setattr(update_formula, "_uv", lambda: ["uv"])
    assert update_formula.resolve("3.13") == [("jinja2", "3.1.6"), ("mlx-metal", "0.32.4"), ("uvicorn", "0.54.0")]
    args = seen["args"]
    assert args[args.index("--python-platform") + 1] == "aarch64-apple-darwin"
    assert args[args.index("--python-version") + 1] == "3.13" and seen["env"]["MACOSX_DEPLOYMENT_TARGET"] == "14.0"


def fake_index(index):
    def index_files(name):
        if name not in index:
            raise urllib.error.HTTPError(f"https://pypi.org/simple/{name}/", 404, "Not Found", None, None)
        return index[name]
    return index_files


def test_update_formula_main_end_to_end(tmp_path, monkeypatch, capsys):
    """The release command on a copy of the formula, with PyPI and uv replaced by fixed answers."""
    formula = tmp_path / "mlxspec.rb"
    formula.write_text(FORMULA.read_text())
    sdist = tmp_path / f"mlxspec-{mlxspec.__version__}.tar.gz"
    sdist.write_bytes(b"release sdist")
    index = {"mlx": [pypi_file("mlx-0.32.4-cp313-cp313-macosx_14_0_arm64.whl")],
             "rich": [pypi_file("rich-15.0.0-py3-none-any.whl"), pypi_file("rich-15.0.0.tar.gz")]}
    monkeypatch.setattr(update_formula, "resolve", lambda python: [("rich", "15.0.0"), ("mlx", "0.32.4")])
    monkeypatch.setattr(update_formula, "index_files", fake_index(index))
    args = ["--formula", str(formula), "--sdist", str(sdist)]

    assert update_formula.main([*args, "--check"]) == 1  # differs: nothing written
    assert formula.read_text() == FORMULA.read_text()
    assert update_formula.main(args) == 0
    text = formula.read_text()
    sha = hashlib.sha256(b"release sdist").hexdigest()
    assert f'sha256 "{sha}"' in text
    source_url = f"https://files.pythonhosted.org/packages/source/m/mlxspec/mlxspec-{mlxspec.__version__}.tar.gz"
    assert f'url "{source_url}"' in text  # not on PyPI yet
    assert text.count("  resource ") == 2 and "rich-15.0.0-py3-none-any.whl\", using: :nounzip" in text
    assert update_formula.main([*args, "--check"]) == 0
    assert "is current" in capsys.readouterr().out
    proc = subprocess.run([_ruby(), "-c", str(formula)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    # uploaded: the hashed address, once PyPI's sha256 is the one built here
    uploaded = pypi_file(sdist.name)
    uploaded["hashes"]["sha256"] = sha
    index["mlxspec"] = [uploaded]
    assert update_formula.main(args) == 0
    assert f'url "{uploaded["url"]}"' in formula.read_text()
    uploaded["hashes"]["sha256"] = "0" * 64
    assert update_formula.main(args) == 1
    assert "is not the sdist built here" in capsys.readouterr().err
    # an sdist of another version is refused with one line
    other = tmp_path / "mlxspec-0.0.1.tar.gz"
    other.write_bytes(b"old")
    assert update_formula.main(["--formula", str(formula), "--sdist", str(other)]) == 1
    assert "is not the sdist of mlxspec" in capsys.readouterr().err


def test_update_formula_says_what_is_wrong_in_one_line(tmp_path, monkeypatch, capsys):
    sdist = tmp_path / f"mlxspec-{mlxspec.__version__}.tar.gz"
    sdist.write_bytes(b"x")
    broken = tmp_path / "broken.rb"
    broken.write_text("class Mlxspec < Formula\nend\n")
    assert update_formula.main(["--formula", str(broken), "--sdist", str(sdist)]) == 1
    assert capsys.readouterr().err.strip() == 'error: the formula has no depends_on "python@X.Y" line'

    def offline(name):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(update_formula, "index_files", offline)
    assert update_formula.main(["--formula", str(FORMULA), "--sdist", str(sdist)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot read PyPI's index") and "\n" not in err


def test_formula_resources_reads_what_ruby_reads(described):
    parsed = update_formula.formula_resources(FORMULA.read_text())
    assert parsed == [(r["name"], r["url"], r["sha256"]) for r in described["resources"]]


def make_wheel(path: Path, name: str, version: str, requires=()):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        lines = [f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Requires-Dist: {r}" for r in requires]
        z.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def make_sdist(path: Path, name: str, version: str, requires=()):
    import io
    import tarfile

    text = "\n".join([f"Metadata-Version: 2.2", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]]).encode() + b"\n"
    with tarfile.open(path, "w:gz") as t:
        info = tarfile.TarInfo(f"{name}-{version}/PKG-INFO")
        info.size = len(text)
        t.addfile(info, io.BytesIO(text))
    return path


def test_missing_dependencies_follows_markers_and_extras():
    env = update_formula.target_environment("3.13")
    roots = ["a>=1", "linuxonly; sys_platform == 'linux'"]
    requires = {"a": ["b[x]", "old; python_version < '3.9'"], "b": ["d; extra == 'x'", "e; extra == 'y'"], "d": []}
    assert update_formula.missing_dependencies(roots, requires, env) == []
    del requires["d"]
    assert update_formula.missing_dependencies(roots, requires, env) == ["b needs d, which has no resource"]
    requires["d"] = []
    requires["a"].append("mac-only; sys_platform == 'darwin' and platform_machine == 'arm64'")
    assert update_formula.missing_dependencies(roots, requires, env) == ["a needs mac-only, which has no resource"]
    assert update_formula.missing_dependencies(["zzz"], requires, env) == ["mlxspec needs zzz, which has no resource"]


def test_requires_dist_from_wheels_and_sdists(tmp_path):
    wheel = make_wheel(tmp_path / "a-1.0-py3-none-any.whl", "a", "1.0", ["b>=2", "c; extra == 'x'"])
    sdist = make_sdist(tmp_path / "b-2.0.tar.gz", "b", "2.0", ["d"])
    assert update_formula._requires_dist(wheel) == ["b>=2", "c; extra == 'x'"]
    assert update_formula._requires_dist(sdist) == ["d"]
    assert update_formula._requires_dist(make_sdist(tmp_path / "e-1.0.tar.gz", "e", "1.0")) == []


def test_verify_hashes_every_download_and_checks_dependencies(tmp_path, monkeypatch):
    wheels = {n: make_wheel(tmp_path / f"{n}-1.0-py3-none-any.whl", n, "1.0") for n in ("a", "b")}
    sha = {n: update_formula.sha256_of(p) for n, p in wheels.items()}
    formula_text = FORMULA.read_text()

    def formula(hashes, names=("a", "b")):
        resources = [update_formula.Resource(n, "1.0", wheels[n].as_uri(), hashes[n]) for n in names]
        return update_formula.rewrite(formula_text, "https://example.invalid/mlxspec-1.0.tar.gz", "f" * 64, resources)

    monkeypatch.setattr(update_formula, "ROOT", tmp_path)  # the project's own requirements: a and b
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "mlxspec"\ndependencies = ["a", "b"]\n')
    assert update_formula.verify(formula(sha)) == []
    assert update_formula.verify(formula(dict(sha, b="0" * 64))) == [
        f"b: {wheels['b'].name} does not have the sha256 in the formula"]
    assert update_formula.verify(formula(sha, names=("a",))) == ["mlxspec needs b, which has no resource"]


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


def test_install_paths_are_documented():
    readme = (ROOT / "README.md").read_text()
    for command in ("brew tap", "brew install", "pipx install mlxspec", "uv tool install mlxspec",
                    "mlxspec[cuda]", "--install-completion"):
        assert command in readme, command
    checklist = (ROOT / "docs" / "releasing.md").read_text()
    assert "scripts/update_formula.py" in checklist and "CHANGELOG" in checklist


# -- completion and NO_COLOR ---------------------------------------------------------------------


def cli_env(tmp_path, **extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(tmp_path / "hub"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1")
    env.pop("NO_COLOR", None)
    env.update(extra)
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def mlxspec_cmd(env, *args):
    return subprocess.run([sys.executable, "-m", "mlxspec", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def complete(env, words, cword):
    env = dict(env, COMP_WORDS=words, COMP_CWORD=str(cword), _MLXSPEC_COMPLETE="complete_bash")
    proc = mlxspec_cmd(env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout.split()


def fake_cached_model(cache: Path, repo_id: str):
    """A Hugging Face cache entry laid out as huggingface_hub writes it (blob + snapshot link)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text('{"model_type": "qwen3"}')
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").symlink_to("../../blobs/abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_completion_scripts_and_install(tmp_path):
    env = cli_env(tmp_path)
    for shell, marker in (("bash", "complete -o default -F _mlxspec_completion mlxspec"),
                          ("zsh", "#compdef mlxspec"), ("fish", "complete --command mlxspec")):
        proc = mlxspec_cmd(env, "--show-completion", shell)
        assert proc.returncode == 0 and marker in proc.stdout, proc.stderr
    proc = mlxspec_cmd(env, "--install-completion", "bash")
    assert proc.returncode == 0, proc.stderr
    home = tmp_path / "home"
    assert "_MLXSPEC_COMPLETE" in (home / ".bash_completions" / "mlxspec.sh").read_text()
    assert ".bash_completions/mlxspec.sh" in (home / ".bashrc").read_text()


def test_completion_of_commands_models_and_choices(tmp_path):
    env = cli_env(tmp_path)
    assert complete(env, "mlxspec ru", 1) == ["run"]
    assert {"serve", "pull", "profile"} <= set(complete(env, "mlxspec ", 1))
    fake_cached_model(tmp_path / "hub", "tiny-org/Tiny-Qwen3")
    models = complete(env, "mlxspec run ", 2)
    assert models[0] == "tiny-org/Tiny-Qwen3" and "qwen3-0.6b" in models  # cached first, then aliases
    assert complete(env, "mlxspec rm tiny", 2) == ["tiny-org/Tiny-Qwen3"]
    assert complete(env, "mlxspec run ./", 2) == []  # paths: the shell's own file completion
    assert complete(env, "mlxspec serve --drafter m", 3) == ["mtp"]
    assert complete(env, "mlxspec run --reasoning o", 3) == ["on", "off"]


def _pty_output(args, env) -> str:
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: mlxspec on a terminal
        os.execvpe(sys.executable, [sys.executable, "-m", "mlxspec", *args], env)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.waitpid(pid, 0)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


COLOR_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def _colors(text) -> set[str]:
    """SGR parameters that set a colour (30-38, 40-48, 90-107), not bold/dim/reset."""
    found = set()
    for params in COLOR_SGR.findall(text):
        for p in params.split(";"):
            if p.isdigit() and (30 <= int(p) <= 48 or 90 <= int(p) <= 107):
                found.add(p)
    return found


@pytest.mark.parametrize("args", [["--help"], ["rm", "no-such/model", "--yes"]])
def test_no_color_on_a_terminal(tmp_path, args):
    env = cli_env(tmp_path, COLUMNS="100")
    assert _colors(_pty_output(args, env)), "expected colours on a terminal without NO_COLOR"
    assert not _colors(_pty_output(args, dict(env, NO_COLOR="1")))
