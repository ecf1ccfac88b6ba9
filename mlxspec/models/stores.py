"""GGUF models other tools already downloaded: Ollama's and LM Studio's stores, read-only.

* Ollama (``$OLLAMA_MODELS``, else ``~/.ollama/models``): ``manifests/<host>/<namespace>/<name>/<tag>``
  are JSON manifests whose ``application/vnd.ollama.image.model`` layer names a blob,
  ``blobs/sha256-<hex>``: the GGUF itself. ``NAME[:TAG]`` means ``registry.ollama.ai/library/NAME``
  with tag ``latest`` unless given; ``user/NAME`` and ``host/user/NAME`` are read as Ollama does.
* LM Studio (``$MLXSPEC_LMSTUDIO_MODELS``, else ``~/.lmstudio/models``, else the older
  ``~/.cache/lm-studio/models``): ``<publisher>/<repo>/<file>.gguf``.

Nothing here writes into either store: a model is converted into mlxspec's own cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelNotFoundError

OLLAMA_PREFIX = "ollama:"
LMSTUDIO_PREFIX = "lmstudio:"
OLLAMA_HOST = "registry.ollama.ai"
MODEL_LAYER = "application/vnd.ollama.image.model"
LMSTUDIO_ENV = "MLXSPEC_LMSTUDIO_MODELS"


@dataclass(frozen=True)
class StoredModel:
    ref: str  # what `mlxspec run` takes: ollama:NAME:TAG or lmstudio:PUBLISHER/REPO/FILE
    path: Path  # the GGUF file
    size: int


def ollama_dir() -> Path:
    env = os.environ.get("OLLAMA_MODELS", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def lmstudio_dir() -> Path:
    env = os.environ.get(LMSTUDIO_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    new, old = Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"
    return new if new.is_dir() or not old.is_dir() else old


def is_store_ref(ref: str) -> bool:
    return ref.startswith((OLLAMA_PREFIX, LMSTUDIO_PREFIX))


def _ollama_parts(name: str) -> tuple[str, str]:
    """NAME[:TAG] -> (manifest path under manifests/, display ref), as Ollama expands names."""
    base, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:  # no tag (a colon before a slash belongs to a host:port)
        base, tag = name, ""
    name = base
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or len(parts) > 3:
        raise ModelNotFoundError(f"'{OLLAMA_PREFIX}{name}' is not an Ollama model name (NAME[:TAG])")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, "library", parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    tag = tag or "latest"
    if "/" in tag or tag in (".", ".."):
        raise ModelNotFoundError(f"'{tag}' is not an Ollama tag")
    return "/".join([*parts, tag]), _ollama_display(parts, tag)


def _ollama_display(parts: list[str], tag: str) -> str:
    if parts[0] == OLLAMA_HOST:
        parts = parts[2:] if parts[1] == "library" else parts[1:]
    return f"{OLLAMA_PREFIX}{'/'.join(parts)}:{tag}"


def _ollama_blob(manifest: Path) -> tuple[Path, int] | None:
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    layers = data.get("layers") if isinstance(data, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == MODEL_LAYER:
            digest = str(layer.get("digest", ""))
            if not digest.startswith("sha256:") or not all(c in "0123456789abcdef" for c in digest[7:]):
                return None
            blob = manifest_root(manifest).parent / "blobs" / digest.replace(":", "-")
            return blob, int(layer.get("size") or 0)
    return None


def manifest_root(manifest: Path) -> Path:
    """The manifests/ folder a manifest file lies under."""
    for parent in manifest.parents:
        if parent.name == "manifests":
            return parent
    return manifest.parent


def ollama_display(name: str) -> str:
    """NAME[:TAG] in full, as `mlxspec list --ollama` shows it: ollama:NAME:TAG (tag latest
    when none is given; registry.ollama.ai/library/ left out)."""
    return _ollama_parts(name)[1]


def _ollama_tags(model_dir: Path) -> list[str]:
    """The tags of one model folder under manifests/ that name a model blob, sorted."""
    try:
        manifests = sorted(p for p in model_dir.iterdir() if p.is_file())
    except OSError:
        return []
    return [p.name for p in manifests if _ollama_blob(p) is not None]


def resolve_ollama(name: str) -> Path:
    """The GGUF blob of Ollama model NAME[:TAG]; ModelNotFoundError (one line) when absent,
    naming the tags the model has when it has others."""
    rel, display = _ollama_parts(name)
    manifest = ollama_dir() / "manifests" / rel
    if not manifest.is_file():
        tags = _ollama_tags(manifest.parent)
        if tags:
            base = display.rpartition(":")[0]
            shown = ", ".join(tags[:8]) + (f" and {len(tags) - 8} more" if len(tags) > 8 else "")
            raise ModelNotFoundError(
                f"{display} is not in Ollama's store ({ollama_dir()}); {base} has the tag"
                f"{'s' * (len(tags) > 1)} {shown}: e.g. `mlxspec run {base}:{tags[0]}`")
        raise ModelNotFoundError(
            f"{display} is not in Ollama's store ({ollama_dir()}); see `mlxspec list --ollama`")
    found = _ollama_blob(manifest)
    if found is None or not found[0].is_file():
        raise ModelNotFoundError(f"{display}: its manifest names no model blob that exists in {ollama_dir()}")
    return found[0]


def resolve_lmstudio(name: str) -> Path:
    """PUBLISHER/REPO[/FILE.gguf] under LM Studio's models folder (one .gguf, or the named one)."""
    root = lmstudio_dir()
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ModelNotFoundError(f"'{LMSTUDIO_PREFIX}{name}' is not an LM Studio model (PUBLISHER/REPO[/FILE])")
    target = root.joinpath(*parts)
    if target.is_file() and target.suffix.lower() == ".gguf":
        return target
    files = sorted(p for p in target.glob("*.gguf") if p.is_file()) if target.is_dir() else []
    files = [p for p in files if not p.name.startswith("mmproj")]  # vision projectors are not models
    if len(files) == 1:
        return files[0]
    if not files:
        raise ModelNotFoundError(f"{LMSTUDIO_PREFIX}{name} is not in LM Studio's store ({root}); "
                                 "see `mlxspec list --lmstudio`")
    raise ModelNotFoundError(f"{LMSTUDIO_PREFIX}{name} holds {len(files)} GGUF files; name one, e.g. "
                             f"{LMSTUDIO_PREFIX}{name}/{files[0].name}")


def resolve_store_ref(ref: str) -> Path:
    if ref.startswith(OLLAMA_PREFIX):
        return resolve_ollama(ref[len(OLLAMA_PREFIX):])
    return resolve_lmstudio(ref[len(LMSTUDIO_PREFIX):])


def list_ollama() -> list[StoredModel]:
    root = ollama_dir() / "manifests"
    found = []
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []:
        parts = list(manifest.relative_to(root).parts)
        blob = _ollama_blob(manifest)
        if len(parts) != 4 or blob is None or not blob[0].is_file():
            continue  # not a model (an adapter, a half-pulled model)
        found.append(StoredModel(_ollama_display(parts[:3], parts[3]), blob[0], blob[0].stat().st_size))
    return found


def list_lmstudio() -> list[StoredModel]:
    root = lmstudio_dir()
    found = []
    for path in sorted(root.glob("*/*/*.gguf")) if root.is_dir() else []:
        if path.is_file() and not path.name.startswith("mmproj"):
            rel = "/".join(path.relative_to(root).parts)
            found.append(StoredModel(f"{LMSTUDIO_PREFIX}{rel}", path, path.stat().st_size))
    return found


def ollama_suggestion(ref: str) -> str | None:
    """ollama:REF when REF, given without the prefix (`mlxspec run smollm2:135m`), is a model in
    Ollama's store; None otherwise (and for anything that is no Ollama name). Only NAME:TAG:
    without a tag, a word is a Hugging Face repo name or a prompt."""
    if ":" not in ref or is_store_ref(ref) or ref.startswith(("/", ".", "~")) or ref.lower().endswith(".gguf"):
        return None
    try:
        rel, display = _ollama_parts(ref)
        manifest = ollama_dir() / "manifests" / rel
        found = manifest.is_file() and _ollama_blob(manifest)
        return display if found and found[0].is_file() else None
    except (ModelNotFoundError, OSError, ValueError):  # a prompt: any text at all
        return None
