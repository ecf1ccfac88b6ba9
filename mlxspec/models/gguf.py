"""Convert a GGUF file (llama.cpp, Ollama, LM Studio) into an mlx-lm checkpoint folder.

* config.json from the ``{arch}.*`` metadata; tokenizer files and chat template from
  ``tokenizer.*`` (:mod:`gguf_tokenizer`).
* Tensors renamed from llama.cpp's names to the Hugging Face ones mlx-lm loads. llama.cpp
  stores Llama's Q/K rows in interleaved rotary order: they are permuted back (rows move freely
  in MLX's quantized layout, so this works on quantized weights too). Gemma norms are stored
  as ``1 + w``: mlx-lm's Gemma adds the 1 itself, so it is taken off.
* Quantized tensors stay quantized: Q4_0 / Q4_1 / Q8_0 exactly, other types (K-quants, ...)
  re-quantized to MLX affine with a note saying so (:mod:`gguf_weights`).
* The metadata is checked against the tensors (and held within bounds) before anything is
  written (:mod:`gguf_checks`); `run FILE.gguf` converts once per file content into mlxspec's
  cache (:mod:`gguf_cache`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ..errors import InvalidCheckpointError, UsageError
from .gguf_checks import check_metadata_values, check_tensors_match_metadata, check_vocabulary
from .gguf_file import GGUFHeader, read_header
from .gguf_tokenizer import eos_token_ids, write_tokenizer
from .gguf_weights import read_weights
from .staging import staged_folder

# general.architecture -> mlx-lm model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma 2/3 have four norms per layer: llama.cpp's ffn_norm is the pre-feed-forward one
_LAYER_GEMMA2 = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_DROPPED = {"rope_freqs.weight"}  # llama.cpp's precomputed rotary factors: mlx-lm computes its own
NAME_MAX = 255  # bytes in one path component (Linux, macOS)
_STAGING_EXTRA = len(".") + len(".partial-") + 10  # staged_folder's name around OUT's, with a pid


@dataclass
class GGUFConvertResult:
    out: Path
    architecture: str
    model_type: str
    types: dict[str, int]  # ggml type -> tensor count in the file
    kept_quantized: int = 0  # tensors kept in their GGUF quantization
    requantized: int = 0  # tensors dequantized and quantized again
    notes: list[str] = field(default_factory=list)


def _get(meta: dict, key: str, default=None, kind=(int, float)):
    value = meta.get(key, default)
    return value if isinstance(value, kind) or value is None else default


def _config(header: GGUFHeader, name: str) -> dict:
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise InvalidCheckpointError(
            f"{name} is a '{arch}' model; GGUF import supports {', '.join(ARCHITECTURES)}")
    meta, p = header.metadata, arch + "."
    required = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
                "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count"}
    config = {"model_type": ARCHITECTURES[arch]}
    for field_name, key in required.items():
        value = meta.get(p + key)
        if isinstance(value, list):  # per-layer counts: uniform ones only
            value = value[0] if value and len(set(value)) == 1 else None
        if not isinstance(value, int) or value <= 0:
            raise InvalidCheckpointError(f"{name} has no usable {p + key} in its metadata")
        config[field_name] = value
    heads = config["num_attention_heads"]
    kv = meta.get(p + "attention.head_count_kv", heads)
    config["num_key_value_heads"] = kv[0] if isinstance(kv, list) and kv else kv
    config["head_dim"] = _get(meta, p + "attention.key_length") or config["hidden_size"] // heads
    config["rms_norm_eps"] = float(_get(meta, p + "attention.layer_norm_rms_epsilon", 1e-6))
    config["rope_theta"] = float(_get(meta, p + "rope.freq_base", 10000.0))
    config["max_position_embeddings"] = _get(meta, p + "context_length", 4096)
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        raise InvalidCheckpointError(f"{name} has no token_embd.weight tensor")
    config["vocab_size"] = embed.shape[0]
    config["tie_word_embeddings"] = "output.weight" not in header.tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
    config["mlp_bias"] = False
    if arch == "gemma2":
        config["attn_logit_softcapping"] = float(_get(meta, p + "attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(_get(meta, p + "final_logit_softcapping", 30.0))
        # llama.cpp's rule: 27B scales queries by hidden / heads, the others by head_dim
        big = config["num_hidden_layers"] == 46
        config["query_pre_attn_scalar"] = config["hidden_size"] // heads if big else config["head_dim"]
    if arch == "gemma3":
        config["query_pre_attn_scalar"] = config["head_dim"]
        config["sliding_window"] = _get(meta, p + "attention.sliding_window", 512)
        config["sliding_window_pattern"] = 6  # fixed in llama.cpp for Gemma 3
        config["rope_local_base_freq"] = 10000.0
        factor = _get(meta, p + "rope.scaling.factor")
        if factor and factor != 1:
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    eos = eos_token_ids(meta)
    if eos:
        config["eos_token_id"] = eos
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if isinstance(bos, int):
        config["bos_token_id"] = bos
    return config


def _check_mlx_lm(config: dict, name: str) -> None:
    """The installed mlx-lm has the model class (loader.check_architecture's test; the loader
    imports this module, so it is not imported back)."""
    from ..compat import model_classes

    try:
        model_classes(config)
    except ValueError:
        import mlx_lm

        raise InvalidCheckpointError(
            f"{name} is a '{config['model_type']}' model, which mlx-lm {mlx_lm.__version__} does not support"
        ) from None


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face tensor name for a llama.cpp one (None: not a tensor mlx-lm has)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    table = _LAYER_GEMMA2 if arch in ("gemma2", "gemma3") else _LAYER
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}.{suffix}"
    return None


def unpermute_rows(x, n_head: int):
    """Undo llama.cpp's rotary row order for Llama Q/K (rows of each head: interleaved pairs ->
    two halves). Works on any array whose first axis is the output rows."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _fix_tensor(gguf_name: str, value, arch: str, config: dict):
    if arch == "llama":
        if ".attn_q." in gguf_name:
            return unpermute_rows(value, config["num_attention_heads"])
        if ".attn_k." in gguf_name:
            return unpermute_rows(value, config["num_key_value_heads"])
    if arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
        return value - 1  # llama.cpp stores Gemma's norms as 1 + w
    return value


def _quant_note(result: GGUFConvertResult, quantized: dict, requantized: dict) -> None:
    if requantized:
        what = ", ".join(f"{n} {t}" for t, n in sorted(requantized.items()))
        bits = sorted({b for b, _ in quantized.values()})
        result.notes.append(
            f"dequantized {what} tensor(s) and re-quantized them to MLX affine "
            f"{'/'.join(map(str, bits))}-bit (group 32); MLX has no kernel for those GGUF types")


def _module_quantization(quantized: dict, arch: str) -> dict | None:
    """mlx-lm's ``quantization`` block: the most common (bits, group) as default, the others per module."""
    if not quantized:
        return None
    counts: dict = {}
    for params in quantized.values():
        counts[params] = counts.get(params, 0) + 1
    bits, group = max(counts, key=counts.get)
    block = {"group_size": group, "bits": bits, "mode": "affine"}
    for stem, (b, g) in quantized.items():
        if (b, g) != (bits, group):
            hf = hf_name(stem + ".weight", arch)
            if hf:
                block[hf[: -len(".weight")]] = {"group_size": g, "bits": b}
    return block


def convert_gguf(source: str | os.PathLike, out: str | os.PathLike, *, force: bool = False,
                 on_step: Callable[[str], None] | None = None,
                 side_files: dict[str, dict] | None = None, dtype: str | None = None) -> GGUFConvertResult:
    """Convert the GGUF file SOURCE into OUT, an mlx-lm checkpoint folder. One-line errors.
    DTYPE (e.g. "float32"): every floating tensor, quantization scales included, in that type;
    None: float16 beside quantized tensors, else as stored.
    SIDE_FILES (file name: record; the cache's source record): written beside the checkpoint as
    JSON, in the same step, each with the time of the conversion."""
    step = on_step or (lambda _message: None)
    source = Path(source).expanduser()
    name = f"'{source.name}'"
    out = _usable_output(out, force)
    step(f"reading {source.name}")
    header = read_header(source)
    config = _config(header, name)
    check_metadata_values(header, name)
    check_vocabulary(header, name)
    check_tensors_match_metadata(header, config, name)
    _check_mlx_lm(config, name)
    arch = header.architecture
    types: dict[str, int] = {}
    for info in header.tensors.values():
        types[info.type_name] = types.get(info.type_name, 0) + 1
    result = GGUFConvertResult(out=out, architecture=arch, model_type=config["model_type"], types=types)

    step("reading the tensors")
    float_dtype = dtype or (None if header.types() <= {"F32", "F16", "BF16"} else "float16")
    weights = read_weights(header, name, float_dtype, cast_scales=dtype is not None)
    tensors, unknown = {}, []
    for key, value in weights.tensors.items():
        if key.rsplit(".", 1)[0] + ".weight" in _DROPPED:
            continue
        target = hf_name(key, arch)
        if target is None:
            unknown.append(key)
            continue
        tensors[target] = _fix_tensor(key, value, arch, config)
    if unknown:
        raise InvalidCheckpointError(
            f"{name} has tensors a '{arch}' model does not ({', '.join(sorted(unknown)[:3])}"
            f"{', ...' if len(unknown) > 3 else ''})")
    if "rope_freqs.weight" in header.tensors:
        result.notes.append("dropped rope_freqs (llama 3.1 rope scaling is not carried over)")
    result.kept_quantized = weights.kept
    result.requantized = sum(weights.requantized.values())
    _quant_note(result, weights.quantized, weights.requantized)
    quantization = _module_quantization(weights.quantized, arch)
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    config["mlxspec"] = {"gguf_source": source.name, "gguf_types": dict(sorted(types.items()))}

    try:  # staged_folder removes what was written if this fails
        out.parent.mkdir(parents=True, exist_ok=True)
        with staged_folder(out) as staging:
            staging.mkdir()
            step("writing the MLX checkpoint")
            _write(staging, config, tensors, header)
            converted = datetime.now(timezone.utc).isoformat(timespec="seconds")
            for file_name, record in (side_files or {}).items():
                (staging / file_name).write_text(json.dumps({**record, "converted": converted}, indent=1),
                                                 encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the checkpoint to '{out}': {err.strerror or err}") from None
    return result


def _usable_output(out: str | os.PathLike, force: bool) -> Path:
    """OUT resolved, after the checks that fail before any work: a name the file system takes
    (with the staging folder's longer one), not a file, empty unless FORCE."""
    try:
        out = Path(out).expanduser().resolve()
        too_long = next((part for part in out.parts if len(os.fsencode(part)) > NAME_MAX), None)
        if too_long is None and len(os.fsencode(out.name)) + _STAGING_EXTRA > NAME_MAX:
            too_long = out.name
        if too_long is not None:
            raise UsageError(f"output path has a name of {len(os.fsencode(too_long))} bytes "
                             f"('{too_long[:40]}...'); names may have at most {NAME_MAX - _STAGING_EXTRA} bytes")
        if out.exists() and not out.is_dir():
            raise UsageError(f"output '{out}' is a file; give a folder")
        if out.is_dir() and any(out.iterdir()) and not force:
            raise UsageError(f"output folder '{out}' exists and is not empty; pass --force to replace it")
    except OSError as err:
        raise UsageError(f"cannot use output '{out}': {err.strerror or err}") from None
    return out


def _write(folder: Path, config: dict, tensors: dict, header: GGUFHeader) -> None:
    import mlx.core as mx

    write_tokenizer(header.metadata, folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {k: config[k] for k in ("eos_token_id", "bos_token_id") if k in config}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    mx.eval(tensors)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "mlx"})

