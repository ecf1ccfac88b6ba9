"""Read a GGUF's tensors into MLX arrays keyed by llama.cpp names, with per-module quantization.

Files holding only F32 / F16 / Q4_0 / Q4_1 / Q8_0 are read by ``mx.load``, which maps the three
block formats exactly onto MLX affine quantization (group 32): the quantized ones come back as
``X.weight`` (packed), ``X.scales``, ``X.biases`` and stay that way. Any other type is decoded
with numpy (:mod:`gguf_decode`; ``mx.load`` decodes Q4_K wrongly and cannot read Q5_* or Q3_K
at all; the rarest types need the optional ``gguf`` package) and quantized again to MLX
affine: 8 bits for 5-bit-and-up formats, 4 bits below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidCheckpointError
from .gguf_decode import decode
from .gguf_file import GGUFHeader, tensor_bytes

NATIVE_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}  # read exactly by mx.load
FLOAT_TYPES = {"F32", "F16", "BF16"}
HIGH_BIT_TYPES = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}  # re-quantized to 8 bits
GROUP_SIZE = 32


@dataclass
class GGUFWeights:
    tensors: dict  # llama.cpp name -> mx.array (quantized: .weight packed, .scales, .biases)
    quantized: dict[str, tuple[int, int]] = field(default_factory=dict)  # stem -> (bits, group size)
    kept: int = 0  # tensors kept in their stored quantization
    requantized: dict[str, int] = field(default_factory=dict)  # source type -> tensors re-quantized


def _one_line(err: BaseException, limit: int = 200) -> str:
    line = " ".join(str(err).split()) or type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_weights(header: GGUFHeader, name: str, float_dtype: str | None,
                 cast_scales: bool = False) -> GGUFWeights:
    """All tensors of HEADER's file; FLOAT_DTYPE (e.g. "float16") casts unquantized floats, and
    with CAST_SCALES the quantized tensors' scales and biases too."""
    if header.types() <= NATIVE_TYPES:
        weights = _read_native(header, name)
    else:
        weights = _read_decoded(header, name)
    if float_dtype is not None:
        import mlx.core as mx

        target = getattr(mx, float_dtype)
        for key, value in weights.tensors.items():
            if mx.issubdtype(value.dtype, mx.floating) and (cast_scales or not key.endswith((".scales", ".biases"))):
                weights.tensors[key] = value.astype(target)
    return weights


def _read_native(header: GGUFHeader, name: str) -> GGUFWeights:
    import mlx.core as mx

    try:
        tensors = mx.load(str(header.path), format="gguf")  # Ollama blobs have no extension
    except Exception as err:  # mlx raises RuntimeError / ValueError on files it cannot map
        raise InvalidCheckpointError(f"cannot read the tensors of {name}: {_one_line(err)}") from None
    weights = GGUFWeights(tensors=tensors)
    for key in [k for k in tensors if k.endswith(".scales")]:
        stem = key[: -len(".scales")]
        packed, scales = tensors[stem + ".weight"], tensors[key]
        bits = packed.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32
        weights.quantized[stem] = (bits, GROUP_SIZE)
        weights.kept += 1
    return weights


def _decode(header: GGUFHeader, info, name: str):
    """One tensor as a float32 numpy array of its shape."""
    import numpy as np

    raw = tensor_bytes(header, info)
    if info.type_name == "F32":
        return np.asarray(raw.view(np.float32).reshape(info.shape))
    if info.type_name == "F16":
        return raw.view(np.float16).reshape(info.shape).astype(np.float32)
    if info.type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    decoded = decode(raw, info.type_name, info.shape)
    if decoded is not None:
        return decoded
    try:  # the rarer types (Q2_K, Q3_K, IQ*): the gguf package's reference decoders, if installed
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        raise InvalidCheckpointError(
            f"{name} holds {info.type_name} tensors, which need the 'gguf' package to decode: "
            "pip install 'mlxspec[gguf]'") from None
    try:
        rows = raw.reshape(info.shape[:-1] + (-1,))
        return dequantize(np.asarray(rows), GGMLQuantizationType[info.type_name]).reshape(info.shape)
    except (KeyError, NotImplementedError, ValueError) as err:
        raise InvalidCheckpointError(
            f"cannot decode tensor '{info.name}' ({info.type_name}) of {name}: {_one_line(err)}") from None


def _read_decoded(header: GGUFHeader, name: str) -> GGUFWeights:
    import mlx.core as mx

    weights = GGUFWeights(tensors={})
    for key, info in header.tensors.items():
        value = mx.array(_decode(header, info, name))
        stem = key[: -len(".weight")] if key.endswith(".weight") else None
        if (info.type_name in FLOAT_TYPES or stem is None or value.ndim != 2
                or value.shape[-1] % GROUP_SIZE):
            weights.tensors[key] = value.astype(mx.float16) if info.type_name != "F32" else value
            continue
        bits = 8 if info.type_name in HIGH_BIT_TYPES else 4
        packed, scales, biases = mx.quantize(value.astype(mx.float16), group_size=GROUP_SIZE, bits=bits)
        mx.eval(packed, scales, biases)  # one tensor at a time: the float copy is freed now
        weights.tensors.update({key: packed, stem + ".scales": scales, stem + ".biases": biases})
        weights.quantized[stem] = (bits, GROUP_SIZE)
        weights.requantized[info.type_name] = weights.requantized.get(info.type_name, 0) + 1
    return weights
