#!/usr/bin/env python3
"""Rewrite Formula/mlxspec.rb for a release: one command.

    python scripts/update_formula.py            # build the sdist, resolve, rewrite the formula
    python scripts/update_formula.py --check    # the same, but only say whether the formula is current
    python scripts/update_formula.py --verify   # download every resource, check its sha256, build
                                                # the sdists the way Homebrew does

Steps: build the sdist (``uv build --sdist``), take its sha256; resolve the runtime dependencies for
the formula's target (macOS 14+ on arm64, CPython of the formula's ``python@`` dependency) with
``uv pip compile --python-platform aarch64-apple-darwin``, so ``sys_platform == 'darwin'`` markers
are the Mac's, not this machine's; pick each pinned package's file from PyPI's JSON simple index;
rewrite the formula's url, sha256 and resource blocks. Needs uv (``pip install uv``) and PyPI.

The formula's url is the release's sdist in a form ``brew audit --strict`` accepts: PyPI's hashed
address once the sdist is on PyPI, else the same file attached to the GitHub release
(``https://github.com/OWNER/NAME/releases/download/vX.Y.Z/mlxspec-X.Y.Z.tar.gz``; ``--github
OWNER/NAME``, default: the repository the formula's homepage names). Never PyPI's unhashed
``/packages/source/`` address (audit: "use the `Source` url found on PyPI downloads page"), a git
url or a branch.

File choice per package, the rule the formula's install method relies on: the wheel pip itself
would pick on macOS 14 arm64 with the target Python, pure or compiled, fetched with
``using: :nounzip`` and pip-installed as a file; an sdist only where no wheel fits. homebrew-core
builds resources from sdists, but mlx and mlx-metal publish none, numpy, tokenizers,
pydantic-core ... would need Rust, CMake and Xcode at install time, and even pure-Python sdists
can need build backends PyPI does not have (filelock 4.2's asks for python-sbom): a wheel installs
the same bytes on every Mac without building anything.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags, mac_platforms
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
FORMULA = ROOT / "Formula" / "mlxspec.rb"
PROJECT = "mlxspec"
INDEX = "https://pypi.org/simple"
# the sdist attached to the GitHub release of tag vVERSION: hashed here before the upload; once the
# sdist is on PyPI the script uses PyPI's hashed address instead
GITHUB_SDIST_URL = "https://github.com/{repo}/releases/download/v{version}/{name}-{version}.tar.gz"
PLACEHOLDER_REPO = f"OWNER/{PROJECT}"  # until the repository's account is named (--github)
MACOS = "14.0"  # mlx's oldest macOS wheels; the formula says `depends_on macos: :sonoma`


class FormulaError(Exception):
    """A problem the release manager fixes: printed as one line, exit 1."""


@dataclass(frozen=True)
class Resource:
    name: str        # canonical PyPI name, as homebrew-core spells resources
    version: str
    url: str
    sha256: str

    @property
    def is_wheel(self) -> bool:
        return self.url.endswith(".whl")

    def ruby(self) -> str:
        using = ", using: :nounzip" if self.is_wheel else ""
        return (f'  resource "{self.name}" do\n'
                f'    url "{self.url}"{using}\n'
                f'    sha256 "{self.sha256}"\n'
                f"  end\n")


# -- choosing a file -----------------------------------------------------------------------------


def target_tags(python: str, macos: str = MACOS) -> list[Tag]:
    """Wheel tags the target interpreter accepts, most preferred first (pip's own order)."""
    major, minor = (int(x) for x in python.split("."))
    os_major, os_minor = (int(x) for x in macos.split("."))
    platforms = list(mac_platforms((os_major, os_minor), "arm64"))
    abi = f"cp{major}{minor}"
    return [*cpython_tags((major, minor), [abi], platforms), *compatible_tags((major, minor), abi, platforms)]


def choose_file(name: str, version: str, files: list[dict], tags: list[Tag]) -> Resource:
    """The file of NAME==VERSION the formula installs, from PyPI simple-index JSON ``files``."""
    rank = {tag: i for i, tag in enumerate(tags)}
    want = Version(version)
    sdist, best, best_rank = None, None, len(rank)
    for f in files:
        if f.get("yanked"):
            continue
        filename = f["filename"]
        try:
            if filename.endswith(".whl"):
                fname, fversion, _, ftags = parse_wheel_filename(filename)
            else:
                fname, fversion = parse_sdist_filename(filename)
                ftags = None
        except ValueError:  # old or odd names (eggs, .zip uploads with bad versions): not ours
            continue
        if canonicalize_name(fname) != canonicalize_name(name) or fversion != want:
            continue
        if ftags is None:
            if filename.endswith(".tar.gz"):
                sdist = f
            continue
        r = min((rank[t] for t in ftags if t in rank), default=None)
        if r is not None and r < best_rank:
            best, best_rank = f, r
    chosen = best if best is not None else sdist
    if chosen is None:
        raise FormulaError(f"{name} {version} has neither an sdist nor a wheel for macOS arm64")
    sha = chosen.get("hashes", {}).get("sha256")
    if not sha:
        raise FormulaError(f"the index gives no sha256 for {chosen['filename']}")
    return Resource(canonicalize_name(name), version, chosen["url"], sha)


# -- rewriting the formula -----------------------------------------------------------------------

_RESOURCE = re.compile(r'^  resource "[^"]+" do\n(?:^    .*\n)*?^  end\n\n?', re.M)
_TOP_URL = re.compile(r'^  url "[^"]*"\n  sha256 "[0-9a-f]*"\n', re.M)
_PYTHON = re.compile(r'depends_on "python@\d+\.\d+"')


def formula_python(text: str) -> str:
    """The X.Y of the formula's ``depends_on "python@X.Y"``."""
    m = _PYTHON.search(text)
    if m is None:
        raise FormulaError('the formula has no depends_on "python@X.Y" line')
    return m.group(0).split("@")[1].rstrip('"')


def rewrite(text: str, url: str, sha256: str, resources: list[Resource]) -> str:
    """TEXT with its top url/sha256 and every resource block replaced (resources sorted by name)."""
    if not _TOP_URL.search(text):
        raise FormulaError("the formula has no top-level url + sha256 lines to rewrite")
    text = _TOP_URL.sub(f'  url "{url}"\n  sha256 "{sha256}"\n', text, count=1)
    text = _RESOURCE.sub("", text)
    anchor = text.find("  def install")
    if anchor < 0:
        raise FormulaError("the formula has no `def install`")
    blocks = "\n".join(r.ruby() for r in sorted(resources, key=lambda r: r.name))
    return text[:anchor] + blocks + "\n" + text[anchor:]


_HOMEPAGE = re.compile(r'^  homepage "https://github\.com/([^/"\s]+/[^/"\s]+)"\n', re.M)
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+$")


def formula_repo(text: str) -> str:
    """OWNER/NAME of the GitHub repository the formula's homepage names (else the placeholder)."""
    m = _HOMEPAGE.search(text)
    return m.group(1) if m else PLACEHOLDER_REPO


def set_repo(text: str, repo: str) -> str:
    """TEXT with its homepage naming the GitHub repository REPO (OWNER/NAME)."""
    if not _REPO.match(repo):
        raise FormulaError(f"--github wants OWNER/NAME, got {repo!r}")
    if _HOMEPAGE.search(text):
        return _HOMEPAGE.sub(f'  homepage "https://github.com/{repo}"\n', text, count=1)
    return text


def audit_url(url: str) -> str | None:
    """Why ``brew audit --strict`` refuses URL as a formula's source url (None: it accepts it): the
    rules of Homebrew's url cops that a release url can break."""
    if not url.startswith("https://"):
        return "the url must be https"
    if re.match(r"https?://(pypi\.python\.org|files\.pythonhosted\.org/packages/source)/", url):
        return "PyPI's /packages/source/ address is refused (use the `Source` url found on PyPI downloads page)"
    if url.startswith("git+") or url.endswith(".git") or "/archive/refs/heads/" in url:
        return "a git url or a branch is not a release: give a versioned tarball"
    if re.match(r"https://github\.com/[^/]+/[^/]+/archive/(?!refs/tags/)", url):
        return "GitHub archive urls must name a tag: /archive/refs/tags/vX.Y.Z.tar.gz"
    if not re.search(r"-\d[^/-]*\.tar\.gz$|/v?\d[^/]*\.tar\.gz$", url):
        return "the url names no version (Homebrew reads the version from the file name)"
    return None


_RESOURCE_FIELDS = re.compile(r'^  resource "([^"]+)" do\n    url "([^"]+)"[^\n]*\n    sha256 "([0-9a-f]+)"\n', re.M)


def formula_resources(text: str) -> list[tuple[str, str, str]]:
    """(name, url, sha256) of every resource block, as rewrite() writes them."""
    return _RESOURCE_FIELDS.findall(text)


def target_environment(python: str) -> dict[str, str]:
    """Marker values of the formula's target: CPython PYTHON on macOS arm64."""
    env = default_environment()
    env.update(sys_platform="darwin", platform_system="Darwin", platform_machine="arm64", os_name="posix",
               implementation_name="cpython", platform_python_implementation="CPython",
               python_version=python, python_full_version=f"{python}.0")
    return env


def missing_dependencies(roots: list[str], requires: dict[str, list[str]], env: dict) -> list[str]:
    """'A needs B' for each requirement on the target of ROOTS (the project's own requirements) and
    of every resource (REQUIRES: name -> its Requires-Dist lines), extras followed, that no
    resource provides."""
    extras = {name: set() for name in requires}
    problems, queue = [], [("mlxspec", line) for line in roots]
    seen = set()
    while queue:
        owner, line = queue.pop()
        req = Requirement(line)
        asked = {""} | (extras.get(owner, set()) if owner != "mlxspec" else set())
        if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in asked):
            continue
        dep = canonicalize_name(req.name)
        if dep not in requires:
            problems.append(f"{owner} needs {req.name}, which has no resource")
            continue
        new = {canonicalize_name(e) for e in req.extras} - extras[dep]
        if dep in seen and not new:
            continue
        seen.add(dep)
        extras[dep] |= new
        queue.extend((dep, child) for child in requires[dep])
    return sorted(set(problems))


def _requires_dist(path: Path) -> list[str]:
    """Requires-Dist of a downloaded wheel (its METADATA) or sdist (its PKG-INFO)."""
    import email.parser
    import tarfile
    import zipfile

    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            text = z.read(name).decode("utf-8")
    else:
        with tarfile.open(path) as t:
            member = next(m for m in t.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
            text = t.extractfile(member).read().decode("utf-8")
    return email.parser.Parser().parsestr(text, headersonly=True).get_all("Requires-Dist") or []


# -- the steps that touch the outside ------------------------------------------------------------


def _uv() -> list[str]:
    exe = shutil.which("uv")
    if exe:
        return [exe]
    try:
        import uv  # noqa: F401  (the PyPI package ships the binary)
    except ImportError:
        raise FormulaError("uv is needed: pip install uv") from None
    return [sys.executable, "-m", "uv"]


def _run(args: list[str], **kwargs) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FormulaError(f"`{' '.join(args[:4])} ...` failed: {tail[0]}")
    return proc.stdout


def build_sdist(out_dir: Path) -> Path:
    _run([*_uv(), "build", "--sdist", "--out-dir", str(out_dir), str(ROOT)])
    found = sorted(out_dir.glob(f"{PROJECT}-*.tar.gz"))
    if len(found) != 1:
        raise FormulaError(f"expected one sdist in {out_dir}, found {len(found)}")
    return found[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve(python: str, macos: str = MACOS) -> list[tuple[str, str]]:
    """(name, version) of every runtime dependency, resolved for macOS arm64 and CPython PYTHON."""
    env = dict(os.environ, MACOSX_DEPLOYMENT_TARGET=macos, UV_PYTHON_DOWNLOADS="never")
    out = _run([*_uv(), "pip", "compile", str(ROOT / "pyproject.toml"), "--quiet",
                "--python-platform", "aarch64-apple-darwin", "--python-version", python,
                "--no-header", "--no-annotate", "--index-url", INDEX], env=env, cwd=ROOT)
    pins = []
    for line in out.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;]+)", line)
        if m is None:
            raise FormulaError(f"unexpected line from uv pip compile: {line!r}")
        pins.append((canonicalize_name(m.group(1)), m.group(2)))
    return pins


def index_files(name: str) -> list[dict]:
    """PyPI's JSON simple index (PEP 691) for NAME: every file with its url and hashes."""
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["files"]


def release_url(version: str, sha256: str, repo: str = PLACEHOLDER_REPO) -> str:
    """Where this version's sdist is downloaded from: PyPI's hashed address once uploaded there (and
    then it must be the very file built here), else the GitHub release of REPO, where the release
    attaches the file built here."""
    try:
        files = index_files(PROJECT)
    except urllib.error.HTTPError as err:
        if err.code != 404:  # 404: the project is not on PyPI yet
            raise
        files = []
    for f in files:
        if f["filename"] == f"{PROJECT}-{version}.tar.gz":
            if f.get("hashes", {}).get("sha256") != sha256:
                raise FormulaError(f"PyPI's {f['filename']} is not the sdist built here (sha256 differs); "
                                   "pass the uploaded file with --sdist")
            return f["url"]
    return GITHUB_SDIST_URL.format(repo=repo, name=PROJECT, version=version)


def download(url: str, dest: Path) -> Path:
    path = dest / url.rsplit("/", 1)[1]
    with urllib.request.urlopen(url, timeout=300) as response, open(path, "wb") as f:
        shutil.copyfileobj(response, f)
    return path


def verify(text: str) -> list[str]:
    """Problems with the formula's resources: each file downloaded and hashed, every dependency of
    every resource (from the files' own metadata) present, every sdist built and installed with
    Homebrew's pip arguments (no deps, no binaries, build isolation) into a scratch venv. Wheels
    are not installed here: they are macOS arm64 builds."""
    from concurrent.futures import ThreadPoolExecutor

    resources = formula_resources(text)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with ThreadPoolExecutor(8) as pool:
            paths = list(pool.map(lambda r: download(r[1], tmp), resources))
        sdists, requires = [], {}
        for (name, url, sha), path in zip(resources, paths):
            if sha256_of(path) != sha:
                problems.append(f"{name}: {path.name} does not have the sha256 in the formula")
                continue
            requires[name] = _requires_dist(path)
            if not url.endswith(".whl"):
                sdists.append(str(path))
        if not problems:
            roots = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
            problems += missing_dependencies(roots, requires, target_environment(formula_python(text)))
        print(f"  {len(resources)} resources downloaded and hashed, their dependencies checked; "
              f"building {len(sdists)} sdists", file=sys.stderr)
        if not sdists:
            return problems
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
        proc = subprocess.run([sys.executable, "-m", "pip", f"--python={tmp / 'venv' / 'bin' / 'python'}",
                               "install", "--no-deps", "--no-binary=:all:", "--ignore-installed",
                               "--no-compile", *sdists], capture_output=True, text=True)
        if proc.returncode != 0:
            problems.append("the sdists do not build: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return problems


def package_version() -> str:
    text = (ROOT / "mlxspec" / "__init__.py").read_text(encoding="utf-8")
    m = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if m is None:
        raise FormulaError("mlxspec/__init__.py has no __version__")
    return m.group(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formula", type=Path, default=FORMULA, help="the formula to rewrite")
    parser.add_argument("--sdist", type=Path, help="an sdist already built (default: build one)")
    parser.add_argument("--url", help="where the release sdist is downloaded from (default: PyPI's hashed "
                                      "address once uploaded, checked against its sha256; else the GitHub "
                                      "release's)")
    parser.add_argument("--github", metavar="OWNER/NAME",
                        help="the GitHub repository of the releases and the homepage (default: the one "
                             "the formula's homepage names)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 and show the diff if the formula is not current")
    parser.add_argument("--verify", action="store_true",
                        help="change nothing; download the formula's resources, check their sha256 "
                             "and build its sdists as Homebrew would")
    args = parser.parse_args(argv)
    if args.verify:
        try:
            problems = verify(args.formula.read_text(encoding="utf-8"))
        except (OSError, urllib.error.URLError, subprocess.CalledProcessError) as err:
            problems = [f"cannot verify: {err}"]
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if not problems:
            print(f"{args.formula}: every resource matches its sha256, every dependency of each is a "
                  "resource, every sdist builds")
        return 1 if problems else 0
    try:
        text = args.formula.read_text(encoding="utf-8")
        repo = args.github or formula_repo(text)
        python = formula_python(text)
        version = package_version()
        with tempfile.TemporaryDirectory() as tmp:
            sdist = args.sdist or build_sdist(Path(tmp))
            if not sdist.name.startswith(f"{PROJECT}-{version}."):
                raise FormulaError(f"{sdist.name} is not the sdist of {PROJECT} {version}")
            sha = sha256_of(sdist)
        url = args.url or release_url(version, sha, repo)
        problem = audit_url(url)
        if problem:
            raise FormulaError(f"{url}: {problem}")
        tags = target_tags(python)
        resources = []
        for name, pinned in resolve(python):
            resources.append(choose_file(name, pinned, index_files(name), tags))
            print(f"  {name} {pinned}: {'wheel' if resources[-1].is_wheel else 'sdist'}", file=sys.stderr)
        new = rewrite(set_repo(text, repo), url, sha, resources)
    except urllib.error.URLError as err:
        print(f"error: cannot read PyPI's index: {err}", file=sys.stderr)
        return 1
    except (FormulaError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if new == text:
        print(f"{args.formula} is current ({PROJECT} {version}, {len(resources)} resources)")
        return 0
    if args.check:
        sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                   str(args.formula), "rewritten"))
        return 1
    args.formula.write_text(new, encoding="utf-8")
    print(f"rewrote {args.formula}: {PROJECT} {version}, sdist sha256 {sha[:12]}..., "
          f"{len(resources)} resources ({sum(r.is_wheel for r in resources)} wheels)")
    if repo == PLACEHOLDER_REPO and "github.com/" in url:
        print(f"note: the url names the placeholder {PLACEHOLDER_REPO}: run again with --github OWNER/NAME",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
