"""Find a model (local folder, Hugging Face cache, configured default or the built-in demo),
check it is a usable mlx-lm checkpoint, and load it.

Nothing here downloads: a repo id must already be in the local Hugging Face cache.
Every failure is an :class:`MlxspecError` with a one-line message.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidCheckpointError, ModelNotFoundError
from .attention_only import fix_loaded
from .stores import is_store_ref, ollama_suggestion, resolve_store_ref

# the files mlx-lm itself reads from a snapshot (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS); a cached
# snapshot only has to be complete for these, not for READMEs or PyTorch weights
SNAPSHOT_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_WEIGHTS_GLOB = "model*.safetensors"  # what mlx_lm.utils.load_model globs for


@dataclass
class LoadedModel:
    model: Any  # mlx.nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    path: Path
    name: str
    is_demo: bool = False
    # the mx.distributed group the model is sharded over (models/sharding.py); None: whole here
    group: Any = None

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding (may exceed the tokenizer's size: padded vocabularies)."""
        import mlx.nn as nn

        for _, module in self.model.named_modules():
            if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
                return int(module.weight.shape[0])
        for cfg in (self.config, self.config.get("text_config") or {}):
            if isinstance(cfg.get("vocab_size"), int):
                return cfg["vocab_size"]
        raise InvalidCheckpointError(f"cannot tell the vocabulary size of {self.name}")

    @property
    def context_length(self) -> int | None:
        """Most tokens (prompt + answer) the model was made for: max_position_embeddings."""
        for cfg in (self.config, self.config.get("text_config") or {}):
            n = cfg.get("max_position_embeddings")
            if isinstance(n, int) and n > 0:
                return n
        return None


# -- resolving ------------------------------------------------------------


def hf_cache_dir() -> Path:
    """The hub cache as huggingface_hub computes it, but read from the environment now.

    huggingface_hub freezes its constants at import; reading the variables at call time keeps
    HF_HOME / HF_HUB_CACHE set later in the process (tests, embedding apps) effective.
    """
    home = os.getenv("HF_HOME") or os.path.join(
        os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface"
    )
    cache = os.getenv("HF_HUB_CACHE") or os.getenv("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def display_path(path: Path) -> str:
    home = Path.home()
    try:
        return "~/" + str(path.relative_to(home))
    except ValueError:
        return str(path)


def _looks_like_path(ref: str) -> bool:
    # repo ids are "name" or "org/name"; anything else with a separator is meant as a folder
    return ref.startswith(("/", ".", "~")) or ref.count("/") > 1


def _from_hf_cache(repo_id: str) -> Path | None:
    """The cached snapshot folder of ``repo_id`` (revision main), or None when not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id,
            local_files_only=True,
            cache_dir=hf_cache_dir(),
            allow_patterns=SNAPSHOT_PATTERNS,
        )
    except (HFValidationError, LocalEntryNotFoundError):
        return None
    except IncompleteSnapshotError:
        raise ModelNotFoundError(
            f"the cached copy of '{repo_id}' in {display_path(hf_cache_dir())} is incomplete; "
            f"download it again (e.g. `hf download {repo_id}`)"
        ) from None
    return Path(folder)


def _demo() -> tuple[Path, str, bool]:
    from .demo import DEMO_NAME, demo_model_path

    return Path(demo_model_path()), DEMO_NAME, True


def _demo_name() -> str | None:
    try:
        from .demo import DEMO_NAME
    except ImportError:  # a source tree without the demo assets
        return None
    return DEMO_NAME


def resolve_model(ref: str | None) -> tuple[Path, str, bool]:
    """``(folder, display name, is_demo)`` for a model reference.

    None -> $MLXSPEC_DEFAULT_MODEL, else ``default_model`` from the config file, else the demo.
    A folder path -> that folder. Anything else -> a repo id already in the Hugging Face cache.
    """
    if ref is None:
        from ..config import default_model

        configured = default_model()
        return resolve_model(configured) if configured else _demo()
    ref = ref.strip()
    if not ref:
        raise ModelNotFoundError("the model name is empty")
    if ref == _demo_name():
        return _demo()
    source = gguf_source(ref)
    if source is not None:  # converted once into mlxspec's cache, then loaded from there
        from .gguf_cache import cached_conversion

        return cached_conversion(source, ref=ref), ref if is_store_ref(ref) else source.name, False
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve(), path.resolve().name, False
    if path.exists():
        raise ModelNotFoundError(f"model '{ref}' is a file; give the folder holding config.json")
    if _looks_like_path(ref):
        raise ModelNotFoundError(f"model folder '{ref}' does not exist")
    folder = _from_hf_cache(ref)
    meant = ollama_suggestion(ref) if folder is None else None
    if meant:  # an Ollama name without its prefix
        raise ModelNotFoundError(
            f"model '{ref}' is not a local folder and is not in the Hugging Face cache; did you mean "
            f"{meant}? (Ollama's models take the prefix: `mlxspec run {meant}`)")
    if folder is None:
        raise ModelNotFoundError(
            f"model '{ref}' is not a local folder and is not in the Hugging Face cache "
            f"({display_path(hf_cache_dir())}); download it first (e.g. `hf download {ref}`)"
        )
    return folder, ref, False


def gguf_source(ref: str) -> Path | None:
    """The GGUF file REF names (FILE.gguf, ollama:NAME[:TAG], lmstudio:PUBLISHER/REPO[/FILE]),
    None when REF is not a GGUF reference; ModelNotFoundError when it is one naming nothing or
    a path the system refuses (a name too long, a folder that cannot be read)."""
    try:
        return _gguf_path(ref)
    except OSError as err:
        raise ModelNotFoundError(f"cannot read '{ref}': {err.strerror or err}") from None


def _gguf_path(ref: str) -> Path | None:
    if is_store_ref(ref):
        return resolve_store_ref(ref)
    if not ref.lower().endswith(".gguf"):
        return None
    path = Path(ref).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file '{ref}' does not exist")
    return path


def is_model_ref(ref: str) -> bool:
    """Whether ``ref`` names a model (folder, cached repo id, demo, GGUF file or store model) —
    the CLI's one-argument rule. Converts nothing. An Ollama NAME:TAG given without ``ollama:``
    counts too: it is meant as a model, and loading it fails saying which prefix it needs."""
    if ollama_suggestion(ref.strip()) is not None and not Path(ref.strip()).expanduser().exists():
        return True
    try:
        if gguf_source(ref.strip()) is not None:
            return True
        resolve_model(ref)
    except ModelNotFoundError:
        return False
    return True


# -- checking and loading -------------------------------------------------


def _one_line(err: BaseException, limit: int = 200) -> str:
    # mlx lists missing/extra parameter names on the lines after the first: keep them, joined
    line = " ".join(str(err).split()) or type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def check_checkpoint(path: Path, name: str) -> dict:
    """Catch the common ways a folder is not a loadable checkpoint; returns the parsed config."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InvalidCheckpointError(f"model '{name}' ({path}) has no config.json")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        message = f"config.json of model '{name}' is not valid JSON: {_one_line(err)}"
        raise InvalidCheckpointError(message) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InvalidCheckpointError(f"config.json of model '{name}' has no \"model_type\"")
    if not any(path.glob(_WEIGHTS_GLOB)):
        raise InvalidCheckpointError(f"model '{name}' ({path}) has no weights ({_WEIGHTS_GLOB} files)")

    check_architecture(config, f"model '{name}'")
    return config


def load_model(ref: str | None, group: Any = None) -> LoadedModel:
    """Resolve, check and load a model with its tokenizer; with GROUP (an ``mx.distributed``
    group), this process's shard of it (models/sharding.py)."""
    if group is not None:  # a bad $MLXSPEC_MTP_HEAD: refused before the load, not at the first MTP draft
        from .mtp import head_layout

        head_layout()
    path, name, is_demo = resolve_model(ref)
    from .gemma4_pairs import is_assistant_folder

    if is_assistant_folder(path):  # a Gemma-4 assistant: no model of mlx-lm's, drafts only
        from .gemma4_assistant import load_assistant

        model, config = load_assistant(path, name)  # the tokenizer is its target's
        ready(model)
        return LoadedModel(model=model, tokenizer=None, config=config, path=path, name=name)
    from .dflash_config import is_dflash_folder

    if is_dflash_folder(path):  # a DFlash block drafter: borrows the target's embedding and head
        from .dflash import load_dflash

        model, config = load_dflash(path, name)
        ready(model)
        return LoadedModel(model=model, tokenizer=None, config=config, path=path, name=name)
    check_checkpoint(path, name)
    if group is not None:
        from .sharding import load_sharded

        model, tokenizer, config = load_sharded(path, name, group)
    else:
        from mlx_lm.utils import load

        try:
            model, tokenizer, config = load(str(path), return_config=True)
        except Exception as err:  # mlx/transformers raise many types for broken files
            raise InvalidCheckpointError(f"cannot load model '{name}': {_one_line(err)}") from err
    fix_loaded(model, path, config)
    from ..kernels import install

    # CUDA verify kernels; a no-op elsewhere or with MLXSPEC_KERNELS=0. A shard's too: each
    # kernel works on the rank's own heads and rows, its collectives stay mlx's (kernels/qmm.py)
    install(model)
    ready(model)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, name=name, is_demo=is_demo,
                       group=group)


def ready(model) -> None:
    """A loaded model as every caller gets it: in this device's fast dtype, fully evaluated."""
    compute_dtype(model)
    evaluate_all(model)


def compute_dtype(model) -> None:
    """On the CPU, compute in float32: MLX's CPU kernels for float16 and bfloat16 (quantized
    matmuls above all: 68.7 ms against 0.79 ms for one 576x1536 layer of SmolLM2) run many times
    slower, so a GGUF import or a 16-bit checkpoint would crawl. On a GPU the checkpoint's own
    16-bit type is the fast one and is kept. Quantized weights stay packed; their scales and
    biases are what is cast."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        model.set_dtype(mx.float32, lambda dtype: dtype in (mx.float16, mx.bfloat16))


def evaluate_all(model) -> None:
    """Evaluate every array the model holds, private ones too: mlx-lm's RoPE classes keep lazy
    ``_freqs`` that ``model.parameters()`` leaves out, and a lazy array made on the loading
    thread cannot be evaluated on another (the server generates on its worker thread: MLX
    streams belong to the thread that made them)."""
    import mlx.core as mx

    mx.eval([v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])


# -- architecture support ---------------------------------------------------


def check_architecture(config: dict, subject: str, failure: str = "does not support") -> None:
    """Raise :class:`InvalidCheckpointError` when the installed mlx-lm has no model for the
    config's model_type: "<subject> has model_type 'x', which mlx-lm <version> <failure>".
    The one check for a config alone (before any weights are on disk, as when pulling)."""
    from ..compat import model_classes

    try:
        model_classes(config)
    except ValueError:
        import mlx_lm

        raise InvalidCheckpointError(
            f"{subject} has model_type '{config.get('model_type')}', "
            f"which mlx-lm {mlx_lm.__version__} {failure}"
        ) from None


def cast_floating(modules: list, dtype: str) -> None:
    """Cast the floating-point parameters of MODULES to DTYPE (quantized weights stay)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    target = getattr(mx, dtype)
    for module in modules:
        module.update(tree_map(lambda p: p.astype(target) if mx.issubdtype(p.dtype, mx.floating) else p,
                               module.parameters()))
        # now, on this thread's stream: a lazy cast evaluated by another thread (the server's
        # worker) fails there
        mx.eval(module.parameters())
