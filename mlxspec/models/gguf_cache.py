"""`mlxspec run FILE.gguf` / `ollama:NAME`: each GGUF is converted once into mlxspec's cache.

* One folder per CONTENT: ``<stem>-<first 16 hex of the file's sha256>``, so a file path and
  the ``ollama:`` name of the same blob (or two copies of one file) share one conversion. An
  Ollama blob is named ``sha256-<hex>`` already and is not hashed again; any other file is
  hashed once (streamed) and the digest remembered against its path, size and modification
  time in ``.hashes.json``, so a second run does not read a multi-GB file again.
* Beside each conversion, ``mlxspec-source.json`` records the digest, every source that led to
  it (the file's absolute path, ``ollama:NAME:TAG``, ``lmstudio:...``) and when it was
  converted: what `mlxspec list` shows and what `mlxspec rm` matches.
* Folders of earlier versions, keyed by path, size and modification time, are renamed to
  their content key the first time their file is run again (quietly); until then they are
  listed with the file name their config.json recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ..errors import InvalidCheckpointError, ModelNotFoundError, UsageError
from .staging import write_whole

CACHE_ENV = "MLXSPEC_GGUF_CACHE"
SOURCE_FILE = "mlxspec-source.json"  # beside the conversion's config.json
HASH_MEMO = ".hashes.json"  # path -> (size, mtime, sha256), in the cache folder
MEMO_ENTRIES = 512  # the most paths remembered; the oldest go first
KEY_CHARS = 16  # hex digits of the sha256 in a folder name
_CHUNK = 8 << 20
_BLOB_NAME = re.compile(r"sha256-([0-9a-f]{64})")


def gguf_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlxspec")) / "gguf"


# -- content digests --------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict) -> None:
    """Written whole or not at all; failures are ignored: the memo and the source record are
    conveniences, never a reason for a run to fail."""
    with contextlib.suppress(OSError):
        write_whole(path, json.dumps(data, indent=1))


def _memo_key(stat: os.stat_result) -> list:
    return [stat.st_size, stat.st_mtime_ns]


def content_digest(path: Path, stat: os.stat_result | None = None,
                   on_step: Callable[[str], None] | None = None, remember: bool = True) -> str:
    """The sha256 (hex) of the file PATH (resolved): its Ollama blob name when it is one, the
    memo when its size and modification time have not changed, else read through once (and
    remembered, unless REMEMBER is false: :func:`remember_digest` then, once the file is known
    to be good)."""
    blob = _BLOB_NAME.fullmatch(path.name)
    if blob:
        return blob.group(1)
    stat = stat or path.stat()
    known = _read_json(gguf_cache_dir() / HASH_MEMO).get(str(path))
    if isinstance(known, dict) and known.get("stat") == _memo_key(stat) and isinstance(known.get("sha256"), str):
        return known["sha256"]
    if on_step:
        on_step(f"hashing {path.name}")
    digest = hash_file(path)
    if remember:
        remember_digest(path, stat, digest)
    return digest


def remember_digest(path: Path, stat: os.stat_result, digest: str) -> None:
    """Keep PATH's digest against its size and modification time (not for Ollama blobs: their
    name is their digest)."""
    if _BLOB_NAME.fullmatch(path.name):
        return
    memo_file = gguf_cache_dir() / HASH_MEMO
    memo = _read_json(memo_file)
    entry = {"stat": _memo_key(stat), "sha256": digest}
    if memo.get(str(path)) == entry:
        return
    memo.pop(str(path), None)  # re-inserted last: the newest entry
    memo[str(path)] = entry
    while len(memo) > MEMO_ENTRIES:
        memo.pop(next(iter(memo)))
    with contextlib.suppress(OSError):
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        _write_json(memo_file, memo)


def hash_file(path: Path) -> str:
    """sha256 of the file PATH, read in 8 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _legacy_name(path: Path, stat: os.stat_result) -> str:
    """The folder name versions before content keys used: the resolved path, size and mtime."""
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:KEY_CHARS]
    return f"{_stem(path.stem)}-{key}"


def _stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:80] or "model"


def source_label(path: Path, ref: str | None) -> str:
    """What a source is recorded and listed as: ollama:NAME:TAG (the full form), the
    lmstudio: reference, or the file's absolute path."""
    from .stores import OLLAMA_PREFIX, ollama_display

    if ref and ref.startswith(OLLAMA_PREFIX):
        with contextlib.suppress(ModelNotFoundError):
            return ollama_display(ref[len(OLLAMA_PREFIX):])
    return ref.strip() if ref else str(path)


def _folder_stem(path: Path, ref: str | None) -> str:
    """The readable part of the folder name: the Ollama model name (its blob is only a digest),
    else the file's stem."""
    from .stores import OLLAMA_PREFIX

    if ref and ref.startswith(OLLAMA_PREFIX):
        return _stem(source_label(path, ref)[len(OLLAMA_PREFIX):].replace(":", "-"))
    return _stem(path.stem)


# -- the conversions in the cache -------------------------------------------------------------


@dataclass
class Conversion:
    name: str  # the folder's name: what `mlxspec list` shows and `mlxspec rm` takes
    path: Path
    sha256: str | None  # None: a folder of an earlier version, keyed by path
    sources: list[str] = field(default_factory=list)
    converted: datetime | None = None
    legacy_source: str | None = None  # an earlier version's folder: the file name config.json names

    @property
    def source(self) -> str:
        return self.sources[0] if self.sources else (self.legacy_source or "?")

    @property
    def size_bytes(self) -> int:
        total = 0
        for p in self.path.rglob("*"):
            with contextlib.suppress(OSError):
                if p.is_file():
                    total += p.stat().st_size
        return total


def _complete(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def _conversion(folder: Path) -> Conversion:
    record = _read_json(folder / SOURCE_FILE)
    sources = [s for s in record.get("sources", []) if isinstance(s, str)]
    digest = record.get("sha256") if isinstance(record.get("sha256"), str) else None
    converted = None
    with contextlib.suppress(TypeError, ValueError):
        converted = datetime.fromisoformat(record["converted"]) if "converted" in record else None
    legacy = None
    if not record:
        with contextlib.suppress(OSError):
            converted = datetime.fromtimestamp((folder / "config.json").stat().st_mtime, timezone.utc)
        recorded = _read_json(folder / "config.json").get("mlxspec")
        legacy = recorded.get("gguf_source") if isinstance(recorded, dict) else None
        legacy = legacy if isinstance(legacy, str) else None
    return Conversion(folder.name, folder, digest, sources, converted, legacy)


def list_conversions() -> list[Conversion]:
    """Every complete conversion in the cache, newest first."""
    root = gguf_cache_dir()
    try:
        folders = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and _complete(p)]
    except OSError:
        return []
    found = [_conversion(p) for p in folders]
    oldest = datetime.min.replace(tzinfo=timezone.utc)
    return sorted(found, key=lambda c: (c.converted or oldest, c.name), reverse=True)


def _by_digest(root: Path, digest: str) -> Path | None:
    suffix = f"-{digest[:KEY_CHARS]}"
    try:
        folders = sorted(p for p in root.iterdir() if p.name.endswith(suffix) and not p.name.startswith("."))
    except FileNotFoundError:
        return None
    for folder in folders:  # a complete one whose record agrees (a 64-bit prefix could collide)
        if _complete(folder) and _read_json(folder / SOURCE_FILE).get("sha256", digest) == digest:
            return folder
    return None


def _record(folder: Path, digest: str, label: str, gguf_bytes: int) -> None:
    """Add LABEL to the sources FOLDER's record names (writing the record an earlier version's
    folder lacks)."""
    record = _read_json(folder / SOURCE_FILE)
    sources = [s for s in record.get("sources", []) if isinstance(s, str)]
    if record and label in sources:
        return
    if "converted" not in record:  # an earlier version's folder: when its config was written
        when = datetime.now(timezone.utc)
        with contextlib.suppress(OSError):
            when = datetime.fromtimestamp((folder / "config.json").stat().st_mtime, timezone.utc)
        record["converted"] = when.isoformat(timespec="seconds")
    record.update(sha256=digest, sources=sources + [label], gguf_bytes=gguf_bytes)
    _write_json(folder / SOURCE_FILE, record)


def cached_conversion(source: str | os.PathLike, on_step: Callable[[str], None] | None = None,
                      ref: str | None = None) -> Path:
    """The mlx-lm folder converted from the GGUF file SOURCE (REF: the name it was given by,
    e.g. ollama:NAME:TAG), converting it on first use; one folder per file content."""
    path = Path(source).expanduser()
    try:  # a name too long for the file system is OSError here, not a missing file
        if not path.is_file():
            raise InvalidCheckpointError(f"GGUF file '{source}' does not exist")
        path = path.resolve()
        stat = path.stat()
        digest = content_digest(path, stat, on_step, remember=False)
    except OSError as err:
        raise InvalidCheckpointError(f"cannot use GGUF file '{source}': {err.strerror or err}") from None
    folder = _cached_folder(path, stat, digest, ref, on_step)
    remember_digest(path, stat, digest)  # after the conversion: nothing is written for a refused file
    return folder


def _cached_folder(path: Path, stat: os.stat_result, digest: str, ref: str | None,
                   on_step: Callable[[str], None] | None) -> Path:
    from .gguf import convert_gguf

    root = gguf_cache_dir()
    label = source_label(path, ref)
    folder = root / f"{_folder_stem(path, ref)}-{digest[:KEY_CHARS]}"
    try:  # the cache folder comes from MLXSPEC_GGUF_CACHE: it can be unusable too
        found = _by_digest(root, digest)
        if found is not None:
            _record(found, digest, label, stat.st_size)
            return found
        legacy = root / _legacy_name(path, stat)
        if _complete(legacy):  # an earlier version's folder for this very file: renamed quietly
            try:
                legacy.rename(folder)
            except OSError:
                folder = legacy
            _record(folder, digest, label, stat.st_size)
            return folder
    except OSError as err:
        raise UsageError(f"cannot use the GGUF cache '{root}' (${CACHE_ENV}): {err.strerror or err}") from None
    convert_gguf(path, folder, force=True, on_step=on_step,
                 side_files={SOURCE_FILE: {"sha256": digest, "sources": [label], "gguf_bytes": stat.st_size}})
    return folder


# -- mlxspec rm -------------------------------------------------------------------------------


def find_conversion(ref: str) -> Conversion | None:
    """The conversion REF names: its listed name, a GGUF file path (the file itself, or the path
    recorded when the file is gone), or an ollama: / lmstudio: name; None when none does."""
    from .stores import LMSTUDIO_PREFIX, OLLAMA_PREFIX, resolve_store_ref

    ref = ref.strip()
    conversions = list_conversions()
    named = next((c for c in conversions if ref in (c.name, str(c.path))), None)
    if named or not ref:
        return named
    with contextlib.suppress(OSError, RuntimeError, ValueError):  # the conversion's folder, given as a path
        folder = Path(ref).expanduser().resolve()
        named = next((c for c in conversions if c.path.resolve() == folder), None)
        if named:
            return named
    path = None
    if ref.startswith((OLLAMA_PREFIX, LMSTUDIO_PREFIX)):
        label = source_label(Path(ref), ref)
        match = next((c for c in conversions if label in c.sources), None)
        if match:
            return match
        with contextlib.suppress(ModelNotFoundError, OSError):
            path = resolve_store_ref(ref).resolve()
    elif ref.lower().endswith(".gguf") or _BLOB_NAME.fullmatch(Path(ref).name) or ref.startswith(("/", ".", "~")):
        with contextlib.suppress(OSError, RuntimeError):
            path = Path(ref).expanduser().resolve()
        if path is None:
            return None
        match = next((c for c in conversions if str(path) in c.sources), None)
        if match:
            return match
    try:
        if path is None or not path.is_file():
            return None
        stat = path.stat()
        legacy = _legacy_name(path, stat)
        match = next((c for c in conversions if c.name == legacy), None)
        if match:
            return match
        digest = content_digest(path, stat)
    except OSError:
        return None
    return next((c for c in conversions if c.sha256 == digest or c.name.endswith(f"-{digest[:KEY_CHARS]}")), None)


def remove_conversion(conversion: Conversion) -> None:
    import shutil

    try:
        shutil.rmtree(conversion.path)
    except OSError as err:
        raise UsageError(f"cannot remove '{conversion.path}': {err.strerror or err}") from None
