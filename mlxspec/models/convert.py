"""Convert a Hugging Face checkpoint to MLX, keeping its native MTP / NextN head.

The trunk goes through mlx-lm's own converter (``mlx_lm.convert.convert``): same sanitize,
dtype rule, quantization, config and tokenizer files as ``mlx_lm.convert``. mlx-lm's sanitize
drops the head, so it is read separately from the SOURCE with :func:`find_mtp_weights`, put in
mlx conventions and written next to the trunk as ``mtp.safetensors``:

* Qwen3.5 / Qwen3.6 / Qwen3-Next (``mtp.*``): norms in mlx's ``x * w`` form (raw zero-centred
  weights get +1 once, in find_mtp_weights; the converted trunk has its conv1d in mlx layout,
  so mlx-lm never shifts its norms again on load), routed experts stacked into mlx-lm's
  ``switch_mlp`` layout, floating tensors cast to the trunk's dtype, linear weights quantized
  with ``mx.quantize`` (affine) at ``mtp_bits`` / ``q_group_size``. Norms, biases, the MoE
  router (``mlp.gate``) and ``shared_expert_gate`` stay unquantized: mlx-lm keeps the routers
  at 8 bits, and mlxspec loads a head quantized uniformly, so they are kept exact instead.
* DeepSeek-V3 / GLM (``model.layers.{N+i}.*``): copied as stored, under the same names.

The head's quantization is recorded where :func:`find_mtp_weights` looks for it (the trunk's
``quantization`` block when both share bits and group size, else inferred from the head's
``fc`` shapes), and ``config.json`` gets an ``"mlxspec"`` note naming the sidecar.

Nothing here downloads: a repo id must already be in the local Hugging Face cache.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InvalidCheckpointError, MlxspecError, UsageError
from .gemma4_pairs import is_assistant_folder
from .staging import staged_folder

SIDECAR = "mtp.safetensors"
BITS = (2, 3, 4, 5, 6, 8)  # mlx affine quantization
GROUP_SIZES = (32, 64, 128)
DTYPES = ("float16", "bfloat16", "float32")  # mlx_lm.convert.MODEL_CONVERSION_DTYPES
# kept unquantized in the head (tiny; mlx-lm keeps them at 8 bits, see the module docstring)
UNQUANTIZED_SUFFIXES = ("mlp.gate.weight", "shared_expert_gate.weight")


@dataclass
class ConvertResult:
    out: Path
    size_bytes: int
    q_bits: int | None  # trunk bits, None when not quantized
    q_group_size: int | None
    dtype: str | None  # the conversion dtype, None when tensors kept their stored dtype
    head_kept: bool
    head_family: str | None = None
    head_layers: int = 0
    head_tensors: int = 0  # tensors in the sidecar (a quantized weight counts with its scales/biases)
    head_bits: int | None = None  # None: unquantized
    head_group_size: int | None = None
    notes: list[str] = field(default_factory=list)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _one_line(err: BaseException, limit: int = 200) -> str:
    line = " ".join(str(err).split()) or type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


# -- checks -----------------------------------------------------------------------------------


def _check_options(q_bits, q_group_size, dtype, mtp_bits) -> int | None:
    """Validates the options; returns the head's bits (None: unquantized)."""
    if q_bits is not None and q_bits not in BITS:
        raise UsageError(f"--q-bits must be one of {', '.join(map(str, BITS))}, got {q_bits}")
    if q_group_size not in GROUP_SIZES:
        raise UsageError(f"--q-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {q_group_size}")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    if mtp_bits is None:
        return q_bits
    if mtp_bits != 0 and mtp_bits not in BITS:
        raise UsageError(f"--mtp-bits must be 0 (unquantized) or one of {', '.join(map(str, BITS))}, got {mtp_bits}")
    head_bits = mtp_bits or None
    if q_bits is not None and head_bits is not None and head_bits != q_bits:
        # find_mtp_weights reads the trunk's quantization block first and mlxspec quantizes a
        # head uniformly: a head at other bits than a quantized trunk would not load
        raise UsageError(
            f"--mtp-bits {mtp_bits} differs from --q-bits {q_bits}: quantize the head like the "
            "trunk, or keep it unquantized with --mtp-bits 0")
    return head_bits


def _mlx_quantization(config: dict) -> dict | None:
    """The mlx-lm ``quantization`` block of an already MLX-quantized source, if any."""
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg, dict) and isinstance(cfg.get("quantization"), dict):
            return cfg["quantization"]
    return None


def _check_requantize(name: str, config: dict, q_bits, q_group_size, head_bits) -> None:
    block = _mlx_quantization(config)
    if block is None:
        return
    if q_bits is not None:
        # mlx-lm leaves already quantized layers as they are: the result would not be q_bits
        raise UsageError(f"model '{name}' is already quantized by MLX; convert it without --q-bits")
    if head_bits is not None and (head_bits, q_group_size) != (block.get("bits"), block.get("group_size")):
        raise UsageError(
            f"model '{name}' is quantized at {block.get('bits')} bits, group {block.get('group_size')}: "
            "quantize its head the same way (--mtp-bits, --q-group-size) or not at all (--mtp-bits 0)")


def _check_out(out: Path, source: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"output '{out}' is a file; give a folder")
    src = source.resolve()
    if out == src or out in src.parents:
        raise UsageError(f"output folder '{out}' would overwrite the source checkpoint")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"output folder '{out}' exists and is not empty; pass --force to replace it")


def _conversion_dtype(config: dict, dtype: str | None) -> str | None:
    """The dtype mlx_lm.convert will cast to (its own rule), or None when it keeps the stored one."""
    if dtype is None:
        dtype = config.get("torch_dtype")
    if dtype is None and isinstance(config.get("text_config"), dict):
        dtype = config["text_config"].get("dtype")
    return dtype if dtype in DTYPES else None


# -- the head ---------------------------------------------------------------------------------


def _unpack(tensors: dict, quant: dict, keep: tuple | None) -> tuple[dict, set]:
    """An mlx affine-quantized head (a source that is itself an MLX conversion): weights already
    at KEEP = (bits, group_size) stay as they are (re-quantizing is not lossless), the others are
    dequantized. Returns the tensors and the module names kept quantized."""
    import mlx.core as mx

    mode = quant.get("mode", "affine")
    if mode != "affine":
        raise InvalidCheckpointError(
            f"the MTP head is stored in {mode} format, which convert cannot re-encode; "
            "convert from the unquantized checkpoint")
    out, kept = dict(tensors), set()
    for key in [k for k in tensors if k.endswith(".scales")]:
        base = key[: -len(".scales")]
        params = quant.get(base) if isinstance(quant.get(base), dict) else quant
        bits, group_size = params.get("bits", 4), params.get("group_size", 64)
        if keep == (bits, group_size) and ".experts." not in base:
            kept.add(base)
            continue
        out[base + ".weight"] = mx.dequantize(
            out[base + ".weight"], out.pop(key), out.pop(base + ".biases", None),
            group_size=group_size, bits=bits, mode="affine")
    return out, kept


def _quantizable(name: str, value, group_size: int) -> bool:
    """mlx-lm's rule (a Linear / SwitchLinear / Embedding weight whose input width the group size
    divides), less the routers kept exact."""
    import mlx.core as mx

    return (name.endswith(".weight") and value.ndim in (2, 3) and mx.issubdtype(value.dtype, mx.floating)
            and not name.endswith(UNQUANTIZED_SUFFIXES) and value.shape[-1] % group_size == 0)


def _qwen_head_tensors(weights, dtype: str | None, bits: int | None, group_size: int) -> dict:
    import mlx.core as mx

    from .mtp.head import to_switch_mlp

    tensors, kept = dict(weights.tensors), set()
    if weights.quantization:
        tensors, kept = _unpack(tensors, weights.quantization, (bits, group_size) if bits else None)
    tensors = to_switch_mlp(tensors)
    if dtype is not None:
        target = getattr(mx, dtype)
        tensors = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()}
    if bits is None:
        return tensors
    out = {}
    for name, value in tensors.items():
        if name[: -len(".weight")] not in kept and _quantizable(name, value, group_size):
            base = name[: -len(".weight")]
            w, scales, biases = mx.quantize(value, group_size=group_size, bits=bits, mode="affine")
            out.update({name: w, base + ".scales": scales, base + ".biases": biases})
        else:
            out[name] = value
    return out


def _nextn_head_tensors(weights, config: dict) -> dict:
    """NextN layers back under their stored names (model.layers.{N+i}.*), as stored."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = text["num_hidden_layers"]
    pattern = re.compile(r"^nextn\.layers\.(\d+)\.(.+)$")
    out = {}
    for key, value in weights.tensors.items():
        m = pattern.match(key)
        out[f"model.layers.{n + int(m.group(1))}.{m.group(2)}"] = value
    return out


def _save_head(path: Path, tensors: dict) -> None:
    import mlx.core as mx

    mx.eval(tensors)
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})


def _note_config(out: Path, result: ConvertResult, head_tensors: dict) -> dict:
    """Records the sidecar in OUT/config.json; returns the updated config."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    note = {"mtp_sidecar": SIDECAR, "mtp_family": result.head_family,
            "mtp_num_layers": result.head_layers, "mtp_bits": result.head_bits}
    if result.head_bits is not None:
        note["mtp_group_size"] = result.head_group_size
    config["mlxspec"] = note
    if result.head_family == "qwen3_5":
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        if not isinstance(text.get("mtp_num_hidden_layers"), int):  # Qwen3-Next has no count
            text["mtp_num_hidden_layers"] = result.head_layers
    config_path.write_text(json.dumps(dict(sorted(config.items())), indent=4), encoding="utf-8")
    return config


def _verify_head(out: Path, config: dict, result: ConvertResult) -> None:
    """The sidecar is found, with the norm convention and quantization it was written in."""
    from .mtp.weights import find_mtp_weights

    found = find_mtp_weights(out, config)
    if found is None or found.num_layers != result.head_layers:
        raise InvalidCheckpointError(f"the written MTP head in {out / SIDECAR} is not found again")
    if found.norms_shifted:
        # the head's own norm statistics look zero-centred: a loader would shift them twice
        raise InvalidCheckpointError(
            "the converted MTP head's norm weights look zero-centred (median |w| < 0.5), so they "
            f"would be shifted again on load; the trunk in {out} is fine, the head is not usable")
    quant = found.quantization
    bits = quant.get("bits") if quant else None
    if result.head_family == "qwen3_5" and bits != result.head_bits:
        raise InvalidCheckpointError(
            f"the converted MTP head would load as {bits or 'un'}-bit instead of {result.head_bits or 'un'}-bit")
    if result.head_family == "qwen3_5":
        from mlx_lm.utils import load_model

        from .mtp import load_mtp_head

        model, model_config = load_model(out, lazy=True)  # lazy: only the head is read
        if load_mtp_head(model, out, model_config) is None:
            raise InvalidCheckpointError(f"the written MTP head in {out / SIDECAR} does not load")


# -- entry point ------------------------------------------------------------------------------


def convert_checkpoint(
    source: str,
    out: str | os.PathLike,
    *,
    q_bits: int | None = None,
    q_group_size: int = 64,
    dtype: str | None = None,
    mtp_bits: int | None = None,
    force: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> ConvertResult:
    """Convert SOURCE (a folder or a cached repo id) into OUT, an mlx-lm checkpoint with the MTP
    head in ``OUT/mtp.safetensors``. ``q_bits`` None: no quantization; ``mtp_bits`` None: as
    ``q_bits``, 0: unquantized head. Raises :class:`MlxspecError` with a one-line message."""
    from .attention_only import needs_norm_shift, shift_saved_norms
    from .loader import check_checkpoint, resolve_model
    from .mtp.weights import find_mtp_weights

    step = on_step or (lambda _message: None)
    head_bits = _check_options(q_bits, q_group_size, dtype, mtp_bits)
    source_path, name, _ = resolve_model(source)
    out = Path(out).expanduser().resolve()
    _check_out(out, source_path, force)

    if is_assistant_folder(source_path):  # no model of mlx-lm's: written by mlxspec's loader
        return _convert_assistant(source_path, name, out, q_bits, q_group_size, dtype, step)
    step(f"checking {name}")
    config = check_checkpoint(source_path, name)
    _check_requantize(name, config, q_bits, q_group_size, head_bits)
    weights = find_mtp_weights(source_path, config)  # lazy: reads nothing yet; fails before the long step
    conv_dtype = _conversion_dtype(config, dtype)
    if weights is not None and weights.family == "qwen3_5" and weights.quantization:
        if weights.quantization.get("mode", "affine") != "affine":
            raise InvalidCheckpointError(
                f"the MTP head of '{name}' is stored in {weights.quantization['mode']} format, "
                "which convert cannot re-encode; convert from the unquantized checkpoint")

    result = ConvertResult(out=out, size_bytes=0, q_bits=q_bits,
                           q_group_size=q_group_size if (q_bits or head_bits) else None,
                           dtype=conv_dtype, head_kept=weights is not None)
    if q_bits is None and (block := _mlx_quantization(config)) is not None:
        result.q_bits, result.q_group_size = block.get("bits"), block.get("group_size")  # kept as is
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(out) as staging:
        what = f"quantizing to {q_bits}-bit" if q_bits else (conv_dtype or "keeping dtypes")
        step(f"converting the trunk with mlx-lm ({what})")
        _convert_trunk(source_path, staging, q_bits, q_group_size, dtype)
        if needs_norm_shift(source_path, config):
            shift_saved_norms(staging)
        if weights is None:
            result.notes.append("no MTP head found; converted the trunk only")
        else:
            step(f"writing the MTP head ({weights.num_layers} layer{'s' * (weights.num_layers != 1)})")
            if weights.family == "qwen3_5":
                tensors = _qwen_head_tensors(weights, conv_dtype, head_bits, q_group_size)
                result.head_bits = head_bits
                result.head_group_size = q_group_size if head_bits else None
            else:
                tensors = _nextn_head_tensors(weights, config)
                if head_bits is not None:
                    result.notes.append("the NextN head is copied as stored (not quantized)")
            _save_head(staging / SIDECAR, tensors)
            result.head_family = weights.family
            result.head_layers = weights.num_layers
            result.head_tensors = len(tensors)
            out_config = _note_config(staging, result, tensors)
            step("checking the converted head loads")
            _verify_head(staging, out_config, result)
    result.size_bytes = _dir_size(out)
    return result


def _convert_assistant(source: Path, name: str, out: Path, q_bits, q_group_size, dtype, step) -> ConvertResult:
    """A Gemma-4 assistant (no model of mlx-lm's): written by mlxspec's own loader."""
    from .gemma4_assistant import save_assistant

    step(f"converting the Gemma-4 assistant {name}" + (f" ({q_bits}-bit)" if q_bits else ""))
    with staged_folder(out) as staging:
        save_assistant(source, staging, q_bits, q_group_size, dtype)
    return ConvertResult(out=out, size_bytes=_dir_size(out), q_bits=q_bits,
                         q_group_size=q_group_size if q_bits else None, dtype=dtype, head_kept=False,
                         notes=["a Gemma-4 assistant: it drafts for its target (--draft-model)"])


def _convert_trunk(source: Path, staging: Path, q_bits, q_group_size, dtype) -> None:
    from mlx_lm.convert import convert

    log = io.StringIO()  # mlx-lm prints "[INFO] ..." lines: keep stdout for the summary
    try:
        with contextlib.redirect_stdout(log):
            convert(hf_path=str(source), mlx_path=str(staging), quantize=q_bits is not None,
                    q_bits=q_bits, q_group_size=q_group_size if q_bits else None, dtype=dtype)
    except MlxspecError:
        raise
    except Exception as err:  # mlx / transformers raise many types for unusable checkpoints
        raise InvalidCheckpointError(f"mlx-lm could not convert '{source}': {_one_line(err)}") from err
