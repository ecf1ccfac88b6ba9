"""Download, list and remove models in the standard Hugging Face cache (shared with mlx-lm).

Everything goes through ``huggingface_hub``; the environment (HF_HOME, HF_HUB_CACHE, HF_TOKEN,
HF_ENDPOINT, HF_HUB_OFFLINE) is read at call time, not when huggingface_hub was imported.
Every failure a user can hit is an :class:`MlxspecError` with a one-line message.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files as package_files
from pathlib import Path
from typing import Callable

from .errors import InvalidCheckpointError, MlxspecError, ModelNotFoundError, UsageError
from .models.loader import SNAPSHOT_PATTERNS, check_architecture, display_path, hf_cache_dir
from .units import human_bytes

MTP_PATTERNS = ["mtp.safetensors", "mtp/*.safetensors", "model-mtp.safetensors"]
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubError(MlxspecError):
    """A download failed (network, authentication, disk)."""


# -- environment ----------------------------------------------------------------------------


def endpoint() -> str:
    return (os.getenv("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    value = os.getenv("HF_HUB_OFFLINE") or os.getenv("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


# -- catalog --------------------------------------------------------------------------------


@dataclass
class CatalogEntry:
    alias: str
    repo: str
    mtp: bool = False
    draft: str | None = None  # an alias or repo id of a recommended draft model
    note: str = ""


@cache
def catalog() -> dict[str, CatalogEntry]:
    data = json.loads(package_files("mlxspec").joinpath("catalog.json").read_text(encoding="utf-8"))
    return {alias.lower(): CatalogEntry(alias=alias, repo=e["repo"], mtp=bool(e.get("mtp")),
                                        draft=e.get("draft"), note=e.get("note", ""))
            for alias, e in data["models"].items()}


def resolve_alias(name: str) -> str | None:
    """What an alias stands for: the user's own (``[aliases]`` in config.toml) first, then the
    catalog's (case-insensitive); None when ``name`` is not an alias."""
    from .config import aliases

    own = aliases().get(name)
    if own:
        return own
    entry = catalog().get(name.strip().lower())
    return entry.repo if entry else None


def expand_alias(ref: str | None) -> str | None:
    """An alias becomes what it stands for; anything else (None included) is returned as is."""
    return (resolve_alias(ref) or ref) if ref else ref


def draft_for(name: str) -> str | None:
    """The recommended draft model's repo id for an alias or repo id in the catalog, if any."""
    key = name.strip().lower()
    entry = catalog().get(key) or next((e for e in catalog().values() if e.repo.lower() == key), None)
    if entry is None or not entry.draft:
        return None
    return resolve_alias(entry.draft) or entry.draft


def to_repo_id(ref: str) -> str:
    """An alias becomes its repo id; anything else is taken as a repo id."""
    ref = ref.strip()
    if not ref:
        raise UsageError("the model name is empty")
    return resolve_alias(ref) or ref


# -- pulling --------------------------------------------------------------------------------


@dataclass
class PullResult:
    repo_id: str
    revision: str
    commit: str
    path: Path
    files: int
    downloaded_bytes: int
    total_bytes: int
    config: dict = field(default_factory=dict)
    already_cached: bool = False


def _patterns(include_mtp: bool) -> tuple[list[str], list[str] | None]:
    if include_mtp:
        return SNAPSHOT_PATTERNS + MTP_PATTERNS, None
    return list(SNAPSHOT_PATTERNS), list(MTP_PATTERNS)


def _progress_class(on_total: Callable[[int], None], on_bytes: Callable[[int], None]):
    """A tqdm stand-in for ``snapshot_download(tqdm_class=...)``: feeds bytes written to callbacks.

    snapshot_download makes a files bar (unit "it"), a network-transfer bar ("Downloading
    bytes") and a bytes-written bar; only the last one is reported (it has exact totals).
    """

    class _Bar:
        def __init__(self, *args, **kwargs):
            self.desc = str(kwargs.get("desc") or "")
            self.unit = kwargs.get("unit", "it")
            self.n = kwargs.get("initial", 0) or 0
            self._total = kwargs.get("total")
            self.disable = False
            self.format_dict = {"rate": None}
            self._report = self.unit == "B" and not self.desc.startswith("Downloading bytes")

        @property
        def total(self):
            return self._total

        @total.setter
        def total(self, value):
            self._total = value
            if self._report and value:
                on_total(int(value))

        def update(self, n=1):
            n = n or 0
            self.n += n
            if self._report and n:
                on_bytes(int(n))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def _ignore(self, *args, **kwargs):
            pass

        close = refresh = set_description = set_description_str = set_postfix = set_postfix_str = _ignore

    return _Bar


def drafter_kind(config: dict | None) -> str | None:
    """"dflash" or "assistant" for the config.json of a drafter-only checkpoint (mlxspec loads
    it itself, beside its target), None for a model; config alone, no mlx import."""
    from .models.dflash_config import is_dflash_config
    from .models.gemma4_pairs import is_assistant_config

    if not isinstance(config, dict):
        return None
    if is_dflash_config(config):
        return "dflash"
    return "assistant" if is_assistant_config(config) else None


def cached_repo_ids() -> list[str]:
    """The model repo ids in the Hugging Face cache, from its folder names (fast: no file is read)."""
    try:
        names = os.listdir(hf_cache_dir())
    except OSError:
        return []
    return sorted(name[len("models--"):].replace("--", "/") for name in names if name.startswith("models--"))


def _check_config(config_path: Path, repo_id: str) -> dict:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InvalidCheckpointError(f"config.json of '{repo_id}' is not valid JSON: {type(err).__name__}") from None
    if drafter_kind(config):  # a DFlash drafter or Gemma-4 assistant: not mlx-lm's to load
        return config
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        raise InvalidCheckpointError(
            f"'{repo_id}' is not a language-model checkpoint: config.json has no \"model_type\"")
    check_architecture(config, f"'{repo_id}'", "cannot load")
    return config


def _hub_errors(err: Exception, repo_id: str, revision: str | None) -> MlxspecError | None:
    """One-line error for a huggingface_hub / network / disk exception (None: not one we know)."""
    from huggingface_hub.errors import (
        DryRunError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    err = _unwrap_dry_run(err)
    where = endpoint()
    site = where.removeprefix("https://")
    if isinstance(err, HFValidationError):
        return UsageError(f"'{repo_id}' is not a valid repo id (expected 'name' or 'org/name') nor a catalog alias")
    if isinstance(err, GatedRepoError):
        if _token():
            return HubError(f"'{repo_id}' is a gated repo and your token has no access: accept its terms "
                            f"on {site}/{repo_id} with the account of that token")
        return HubError(f"'{repo_id}' is a gated repo: accept its terms on {site}/{repo_id}, then set "
                        "HF_TOKEN (or run `hf auth login`)")
    if isinstance(err, RevisionNotFoundError):
        return ModelNotFoundError(f"revision '{revision}' not found in '{repo_id}'")
    if isinstance(err, RepositoryNotFoundError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        hint = " (or it is private: set HF_TOKEN)" if status == 401 and not _token() else ""
        hint = hint or (" (or your token cannot see it)" if status in (401, 403) else "")
        return ModelNotFoundError(f"repo '{repo_id}' not found on {where}{hint}")
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            hint = "set HF_TOKEN (or run `hf auth login`)" if not _token() else "your token has no access"
            return HubError(f"access to '{repo_id}' denied (HTTP {status}): {hint}")
        return HubError(f"download of '{repo_id}' failed: HTTP {status} from {where}; run the same "
                        "command again to resume")
    if isinstance(err, OfflineModeIsEnabled) or (isinstance(err, LocalEntryNotFoundError) and offline()):
        return ModelNotFoundError(f"'{repo_id}' is not in the Hugging Face cache ({display_path(hf_cache_dir())}) "
                                  "and offline mode is on (HF_HUB_OFFLINE); unset it to download")
    if isinstance(err, LocalEntryNotFoundError):
        return HubError(f"cannot reach {where} and '{repo_id}' is not in the Hugging Face cache; "
                        "check your network connection (or HF_ENDPOINT)")
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        free = shutil.disk_usage(hf_cache_dir()).free if hf_cache_dir().exists() else None
        left = f" ({human_bytes(free)} left)" if free is not None else ""
        return HubError(f"disk full while downloading '{repo_id}' to {display_path(hf_cache_dir())}{left}; "
                        "free some space (`mlxspec list`, `mlxspec rm MODEL`) and pull again to resume")
    if isinstance(err, DryRunError):
        return HubError(f"cannot reach {where} for '{repo_id}': check your network connection (or HF_ENDPOINT)")
    if isinstance(err, _httpx().TransportError):
        detail = " ".join(str(err).split())[:120] or type(err).__name__
        return HubError(f"network error while downloading '{repo_id}' from {where}: {detail}; "
                        "run the same command again to resume")
    return None


def _unwrap_dry_run(err: BaseException) -> BaseException:
    from huggingface_hub.errors import DryRunError

    while isinstance(err, DryRunError) and err.__cause__ is not None:  # dry runs wrap the real error
        err = err.__cause__
    return err


def _httpx():
    try:
        import httpx2 as httpx  # what huggingface_hub 2.x uses
    except ImportError:  # pragma: no cover
        import httpx
    return httpx


def _snapshot(repo_id: str, **kwargs):
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, cache_dir=hf_cache_dir(), endpoint=endpoint(), **kwargs)


def pull(ref: str, *, revision: str | None = None, include_mtp: bool = True,
         on_start: Callable[[int, int], None] | None = None,
         on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None) -> PullResult:
    """Download ``ref`` (alias or repo id) into the Hugging Face cache; returns where it landed.

    ``on_start(files_to_download, bytes_to_download)`` is called once the file list is known,
    ``on_bytes(n)`` as bytes are written. Files already cached are not downloaded again, so
    running it again after an interruption finishes the job.
    """
    repo_id = to_repo_id(ref)
    rev = revision or "main"
    allow, ignore = _patterns(include_mtp)
    try:
        if offline():
            path = Path(_snapshot(repo_id, revision=rev, allow_patterns=allow, ignore_patterns=ignore,
                                  local_files_only=True))
            config = _check_folder(path, repo_id)
            return PullResult(repo_id, rev, path.name, path, 0, 0, 0, config, already_cached=True)

        silent = _progress_class(lambda n: None, lambda n: None)
        plan = _snapshot(repo_id, revision=rev, allow_patterns=allow, ignore_patterns=ignore, dry_run=True,
                         tqdm_class=silent)
        names = {f.filename for f in plan}
        commit = plan[0].commit_hash if plan else None
        if "config.json" not in names:
            raise InvalidCheckpointError(
                f"'{repo_id}' is not a Hugging Face / MLX model checkpoint: it has no config.json")
        if not any(n.startswith("model") and n.endswith(".safetensors") and n != "model-mtp.safetensors"
                   for n in names):
            raise InvalidCheckpointError(f"'{repo_id}' has no safetensors weights (model*.safetensors); "
                                         "mlx-lm needs a safetensors checkpoint")
        # the config first (small): an unsupported architecture fails before gigabytes move
        from huggingface_hub import hf_hub_download

        config_path = hf_hub_download(repo_id, "config.json", revision=commit, cache_dir=hf_cache_dir(),
                                      endpoint=endpoint())
        _check_config(Path(config_path), repo_id)

        todo = [f for f in plan if f.will_download]
        total = sum(f.file_size or 0 for f in todo)
        if on_start:
            on_start(len(todo), total)
        tqdm_class = _progress_class(on_total or (lambda n: None), on_bytes or (lambda n: None))
        for f in todo:
            _fetch_blob(repo_id, f.filename, commit, tqdm_class)
        # every blob is in place now: this only links them into the snapshot (and fetches
        # anything the loop could not, e.g. Xet-only files, its own way)
        path = Path(_snapshot(repo_id, revision=rev, allow_patterns=allow, ignore_patterns=ignore,
                              tqdm_class=tqdm_class))
    except MlxspecError:
        raise
    except Exception as err:
        if _is_connection_error(err):
            cached = _cached(repo_id, rev, allow, ignore)
            if cached is not None:  # no network, but nothing to download: fine
                return PullResult(repo_id, rev, cached.name, cached, 0, 0, 0, _check_folder(cached, repo_id),
                                  already_cached=True)
        mapped = _hub_errors(err, repo_id, revision)
        if mapped is None:
            raise
        raise mapped from None
    config = _check_folder(path, repo_id)
    return PullResult(repo_id, rev, path.name, path, len(todo), total, sum(f.file_size or 0 for f in plan),
                      config, already_cached=not todo)


def _fetch_blob(repo_id: str, filename: str, commit: str | None, tqdm_class) -> None:
    """Download one file into the cache's blob store, resumably.

    huggingface_hub writes to a process-unique temporary file and drops it on failure, so an
    interrupted pull (Ctrl-C, a lost connection) would restart every half-done file. Here the
    bytes go to ``blobs/<etag>.partial``, kept across runs and continued with a Range request;
    the finished blob is renamed into place, where ``snapshot_download`` finds and links it.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo_id, filename, revision=commit, endpoint=endpoint())
    meta = get_hf_file_metadata(url, endpoint=endpoint())
    if not meta.etag:
        return  # let snapshot_download deal with it
    blobs = hf_cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"
    blob = blobs / meta.etag
    if blob.exists():
        return
    blobs.mkdir(parents=True, exist_ok=True)
    partial = blobs / f"{meta.etag}.partial"
    done = partial.stat().st_size if partial.exists() else 0
    if meta.size is not None and done > meta.size:  # not the file we think: start over
        partial.unlink()
        done = 0
    if meta.size is None or done < meta.size:
        with open(partial, "ab") as out:
            http_get(meta.location, out, resume_size=done, headers=build_hf_headers(),
                     expected_size=meta.size, displayed_filename=filename, tqdm_class=tqdm_class)
    partial.replace(blob)


def _is_connection_error(err: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    httpx = _httpx()
    return isinstance(_unwrap_dry_run(err), (httpx.ConnectError, httpx.ConnectTimeout, OfflineModeIsEnabled))


def _cached(repo_id: str, revision: str, allow, ignore) -> Path | None:
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(_snapshot(repo_id, revision=revision, allow_patterns=allow, ignore_patterns=ignore,
                              local_files_only=True))
    except (HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError):
        return None


def _check_folder(path: Path, repo_id: str) -> dict:
    if not (path / "config.json").is_file():
        raise InvalidCheckpointError(f"'{repo_id}' is not a Hugging Face / MLX model checkpoint: it has no config.json")
    if not any(path.glob("model*.safetensors")):
        raise InvalidCheckpointError(f"'{repo_id}' has no safetensors weights (model*.safetensors)")
    return _check_config(path / "config.json", repo_id)


# -- listing --------------------------------------------------------------------------------


def describe(path: Path, config: dict) -> dict:
    """Architecture, quantization, MTP head, context length and drafter kind of a checkpoint folder."""
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else {}
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    group = quant.get("group_size") if isinstance(quant, dict) else None
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    try:
        from .models.mtp.weights import find_mtp_weights

        mtp = find_mtp_weights(path, config) is not None
    except Exception:  # a broken head or unreadable weights: not usable as a head
        mtp = False
    return {
        "architecture": config.get("model_type") or text.get("model_type"),
        "quantization": {"bits": bits, "group_size": group} if bits else None,
        "mtp": mtp,
        "context_length": context,
        "drafter": drafter_kind(config),  # a drafter-only checkpoint: "dflash" or "assistant"
    }


def list_models() -> list[dict]:
    """Every model repo in the Hugging Face cache, newest revision per repo (``main`` first)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hf_cache_dir())
    except CacheNotFound:
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        path = Path(revision.snapshot_path)
        row = {"repo_id": repo.repo_id, "revision": revision.commit_hash,
               "refs": sorted(revision.refs), "size_bytes": repo.size_on_disk,
               "size": human_bytes(repo.size_on_disk), "path": str(path)}
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError
        except (OSError, ValueError):
            row.update(architecture=None, quantization=None, mtp=False, context_length=None, drafter=None)
        else:
            row.update(describe(path, config))
        rows.append(row)
    return rows


# -- removing -------------------------------------------------------------------------------


@dataclass
class Removal:
    repo_id: str
    freed_bytes: int
    strategy: object  # huggingface_hub DeleteCacheStrategy

    def execute(self) -> None:
        self.strategy.execute()


def plan_removal(ref: str) -> Removal:
    """What removing ``ref`` (alias or repo id, every cached revision) would free."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    repo_id = to_repo_id(ref)
    try:
        info = scan_cache_dir(hf_cache_dir())
    except CacheNotFound:
        info = None
    repos = [r for r in (info.repos if info else ()) if r.repo_type == "model"]
    match = next((r for r in repos if r.repo_id == repo_id), None) or next(
        (r for r in repos if r.repo_id.lower() == repo_id.lower()), None)
    if match is None:
        raise ModelNotFoundError(f"'{repo_id}' is not in the Hugging Face cache ({display_path(hf_cache_dir())}); "
                                 "see `mlxspec list`")
    strategy = info.delete_revisions(*[r.commit_hash for r in match.revisions])
    return Removal(match.repo_id, strategy.expected_freed_size, strategy)
