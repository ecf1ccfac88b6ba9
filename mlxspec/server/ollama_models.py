"""What the Ollama surface says about the one served model: ``/api/tags``, ``/api/show`` and
``/api/ps`` entries (family, size, parameter count, quantization, context, capabilities), read
from the loaded model's config and files. A test's stand-in model may lack any of them: each
field falls back to what Ollama sends when it does not know.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from pathlib import Path

from ..options import OLLAMA_DEFAULTS

DTYPE_LEVELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def now_rfc3339() -> str:
    return rfc3339(datetime.now(timezone.utc))


def rfc3339(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def _config(spec) -> dict:
    config = getattr(getattr(spec, "target", None), "config", None)
    return config if isinstance(config, dict) else {}


def _text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal checkpoints nest it)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def _path(spec) -> Path | None:
    path = getattr(getattr(spec, "target", None), "path", None)
    return Path(path) if path is not None else None


def _bits(config: dict) -> int | None:
    q = config.get("quantization") or config.get("quantization_config")
    bits = q.get("bits") if isinstance(q, dict) else None
    return bits if isinstance(bits, int) and bits > 0 else None


def quantization_level(config: dict) -> str:
    """Q4, Q8 ... for a quantized checkpoint, else its dtype as Ollama names them (BF16, F16)."""
    bits = _bits(config)
    if bits:
        return f"Q{bits}"
    dtype = config.get("torch_dtype") or config.get("dtype") or _text_config(config).get("torch_dtype")
    return DTYPE_LEVELS.get(str(dtype), str(dtype).upper() if dtype else "unknown")


def parameter_count(spec) -> int:
    """The model's parameters; a quantized matrix counts the values packed in its words."""
    model = getattr(getattr(spec, "target", None), "model", None)
    if model is None or not hasattr(model, "parameters"):
        return 0
    from mlx.utils import tree_flatten

    bits = _bits(_config(spec))
    n = 0
    for name, value in tree_flatten(model.parameters()):
        if bits and name.endswith((".scales", ".biases")):  # the quantization's own numbers
            continue
        packed = bits and str(value.dtype) == "mlx.core.uint32"
        n += value.size * (32 // bits) if packed else value.size
    return n


def parameter_size(n: int) -> str:
    """As Ollama writes it: 8.0B, 596.05M."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.2f}K" if n else "unknown"


def size_bytes(spec) -> int:
    """Bytes of the checkpoint's weight files."""
    path = _path(spec)
    if path is None or not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def modified_at(spec) -> str:
    path = _path(spec)
    try:
        when = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc) if path is not None else None
    except OSError:
        when = None
    return rfc3339(when or datetime.fromtimestamp(0, timezone.utc))


def digest(spec, name: str) -> str:
    """A stable identifier of the served checkpoint (Ollama's is its manifest's sha256)."""
    return hashlib.sha256(f"{name}\0{_path(spec)}".encode()).hexdigest()


def details(spec) -> dict:
    config = _config(spec)
    family = str(_text_config(config).get("model_type") or config.get("model_type") or "unknown")
    return {"parent_model": "", "format": "mlx", "family": family, "families": [family],
            "parameter_size": parameter_size(parameter_count(spec)), "quantization_level": quantization_level(config)}


def model_details(spec, name: str) -> dict:
    """An ``/api/tags`` entry."""
    return {"name": name, "model": name, "modified_at": modified_at(spec), "size": size_bytes(spec),
            "digest": digest(spec, name), "details": details(spec)}


def context_length(spec) -> int | None:
    n = getattr(getattr(spec, "target", None), "context_length", None)
    return n if isinstance(n, int) and n > 0 else None


def chat_template(spec) -> str:
    template = getattr(getattr(spec, "tokenizer", None), "chat_template", None)
    return template if isinstance(template, str) else ""


def capabilities(spec) -> list[str]:
    """What the chat template offers: tools when it renders them, thinking when it has a switch."""
    template = chat_template(spec)
    caps = ["completion"]
    if "tools" in template:
        caps.append("tools")
    if "enable_thinking" in template or "<think>" in template:
        caps.append("thinking")
    return caps


def show_model(spec, name: str) -> dict:
    """The ``/api/show`` answer."""
    config = _text_config(_config(spec))
    info = details(spec)
    family = info["family"]
    model_info: dict = {"general.architecture": family, "general.parameter_count": parameter_count(spec)}
    for key, ours in (("context_length", context_length(spec)), ("embedding_length", config.get("hidden_size")),
                      ("block_count", config.get("num_hidden_layers")),
                      ("attention.head_count", config.get("num_attention_heads")),
                      ("vocab_size", config.get("vocab_size"))):
        if isinstance(ours, int):
            model_info[f"{family}.{key}"] = ours
    parameters = "\n".join(f"{k:<16}{v}" for k, v in OLLAMA_DEFAULTS.items())  # what a request's options default to
    # the name it is served under: the path on disk is the server's business, not a client's
    return {"modelfile": f"# served by mlxspec\nFROM {name}\n", "parameters": parameters,
            "template": chat_template(spec), "details": info, "model_info": model_info,
            "capabilities": capabilities(spec), "modified_at": modified_at(spec)}


def running_model(spec, name: str) -> dict:
    """An ``/api/ps`` entry: the model stays loaded while the server runs."""
    size = size_bytes(spec)
    return {**model_details(spec, name), "size_vram": size, "context_length": context_length(spec),
            "expires_at": rfc3339(datetime.now(timezone.utc) + timedelta(days=365 * 100))}
