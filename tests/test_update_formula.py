"""scripts/update_formula.py without the network: file choice, the rewrite, uv's pins, the
release command end to end, and --verify's hashing and dependency check."""

import hashlib
import subprocess
import urllib.error
from pathlib import Path

import pytest

import mlxspec
from formula_helpers import FORMULA, file_name, ruby, update_formula

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
    chosen = update_formula.choose_file("tokenizers", "0.23.3", abi3, TAGS)
    assert file_name(chosen.url).endswith("abi3-macosx_11_0_arm64.whl")


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
    packages = "https://files.pythonhosted.org/packages"
    resources = [update_formula.Resource("zeta", "1.0", f"{packages}/z/zeta-1.0.tar.gz", "1" * 64),
                 update_formula.Resource("alpha", "2.0", f"{packages}/a/alpha-2.0-cp313-cp313-macosx_14_0_arm64.whl",
                                         "2" * 64)]
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
    version = mlxspec.__version__
    release = f"https://github.com/OWNER/mlxspec/releases/download/v{version}/mlxspec-{version}.tar.gz"
    assert f'url "{release}"' in text  # not on PyPI yet: the sdist of the GitHub release
    assert "/packages/source/" not in text
    assert text.count("  resource ") == 2 and "rich-15.0.0-py3-none-any.whl\", using: :nounzip" in text
    assert update_formula.main([*args, "--check"]) == 0
    assert "is current" in capsys.readouterr().out
    proc = subprocess.run([ruby(), "-c", str(formula)], capture_output=True, text=True)
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


@pytest.mark.parametrize("url, problem", [
    ("https://github.com/me/mlxspec/releases/download/v1.2.3/mlxspec-1.2.3.tar.gz", None),
    ("https://github.com/me/mlxspec/archive/refs/tags/v1.2.3.tar.gz", None),
    ("https://files.pythonhosted.org/packages/ab/cd/0123abcd/mlxspec-1.2.3.tar.gz", None),
    ("https://files.pythonhosted.org/packages/source/m/mlxspec/mlxspec-1.2.3.tar.gz", "Source` url"),
    ("https://pypi.python.org/packages/source/m/mlxspec/mlxspec-1.2.3.tar.gz", "Source` url"),
    ("https://github.com/me/mlxspec.git", "git url"),
    ("https://github.com/me/mlxspec/archive/refs/heads/main.tar.gz", "branch"),
    ("https://github.com/me/mlxspec/archive/v1.2.3.tar.gz", "refs/tags"),
    ("http://example.com/mlxspec-1.2.3.tar.gz", "https"),
    ("https://example.com/mlxspec.tar.gz", "no version"),
])
def test_audit_url_refuses_what_brew_audit_refuses(url, problem):
    found = update_formula.audit_url(url)
    assert (found is None) if problem is None else (problem in found), found


def test_github_repository_names_the_release_url_and_homepage(tmp_path, monkeypatch, capsys):
    formula = tmp_path / "mlxspec.rb"
    formula.write_text(FORMULA.read_text())
    sdist = tmp_path / f"mlxspec-{mlxspec.__version__}.tar.gz"
    sdist.write_bytes(b"release sdist")
    monkeypatch.setattr(update_formula, "resolve", lambda python: [("rich", "15.0.0")])
    index = {"rich": [pypi_file("rich-15.0.0-py3-none-any.whl")]}
    monkeypatch.setattr(update_formula, "index_files", fake_index(index))
    assert update_formula.main(["--formula", str(formula), "--sdist", str(sdist)]) == 0
    assert "placeholder OWNER/mlxspec" in capsys.readouterr().err
    assert update_formula.main(["--formula", str(formula), "--sdist", str(sdist), "--github", "someone/mlxspec"]) == 0
    text = formula.read_text()
    version = mlxspec.__version__
    assert f'url "https://github.com/someone/mlxspec/releases/download/v{version}/mlxspec-{version}.tar.gz"' in text
    assert 'homepage "https://github.com/someone/mlxspec"' in text and "OWNER" not in text.split("  resource")[0]
    # the next run keeps the repository the homepage names
    assert update_formula.main(["--formula", str(formula), "--sdist", str(sdist), "--check"]) == 0
    assert update_formula.main(["--formula", str(formula), "--sdist", str(sdist), "--github", "not a repo"]) == 1
    assert "--github wants OWNER/NAME" in capsys.readouterr().err
    # a url the audit refuses is not written
    refused = "https://files.pythonhosted.org/packages/source/m/mlxspec/mlxspec-{}.tar.gz".format(version)
    assert update_formula.main(["--formula", str(formula), "--sdist", str(sdist), "--url", refused]) == 1
    assert "Source` url" in capsys.readouterr().err and refused not in formula.read_text()


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


def make_wheel(path: Path, name: str, version: str, requires=()):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Requires-Dist: {r}" for r in requires]
        z.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def make_sdist(path: Path, name: str, version: str, requires=()):
    import io
    import tarfile

    text = "\n".join(["Metadata-Version: 2.2", f"Name: {name}", f"Version: {version}",
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
