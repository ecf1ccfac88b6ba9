"""Read a GGUF file's header: metadata and tensor table, checked against the file's size.

Pure Python (no mlx, no ``gguf`` package): the header is parsed and every tensor's extent is
checked before any data is touched, so a truncated or lying file is one line, never a crash
inside a native reader. Tensor data stays on disk; :func:`tensor_bytes` maps one tensor.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidCheckpointError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# a sane ceiling for one header string or array: a lying length must not allocate gigabytes
MAX_ITEMS = 1 << 26
# arrays of arrays: llama.cpp writes none, and each level is one Python stack frame here
MAX_ARRAY_DEPTH = 8

# ggml type id -> (name, elements per block, bytes per block), as ggml defines them
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}

# metadata value types: id -> struct format (strings and arrays are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF stores dimensions innermost first
    type_name: str
    offset: int  # absolute, in the file
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def types(self) -> set[str]:
        return {t.type_name for t in self.tensors.values()}


class _Reader:
    def __init__(self, f, name: str, size: int):
        self.f, self.name, self.size = f, name, size

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise InvalidCheckpointError(f"{self.name} is truncated (its header ends early)")
        return data

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        n = self.scalar("<Q")
        # every item takes at least one byte: a count past the file's end is a lie, whatever its size
        if n > MAX_ITEMS or n > self.size - self.f.tell():
            raise InvalidCheckpointError(f"{self.name} is not a valid GGUF file (a {what} claims {n:,} items)")
        return n

    def string(self) -> str:
        return self.take(self.count("string")).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise InvalidCheckpointError(
                    f"{self.name} is not a valid GGUF file (metadata arrays nested more than "
                    f"{MAX_ARRAY_DEPTH} deep)")
            item_kind, n = self.scalar("<I"), self.count("metadata array")
            if item_kind in _SCALARS:  # one read for a whole numeric array
                fmt = _SCALARS[item_kind]
                return list(struct.unpack(f"<{n}{fmt[1]}", self.take(n * struct.calcsize(fmt))))
            return [self.value(item_kind, depth + 1) for _ in range(n)]
        raise InvalidCheckpointError(f"{self.name} is not a valid GGUF file (unknown metadata type {kind})")


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Metadata and tensor table of the GGUF file PATH; raises InvalidCheckpointError (one line)
    when the file is not GGUF, is truncated, or names tensors that do not fit inside it."""
    path = Path(path)
    name = f"'{path.name}'"
    try:
        size = path.stat().st_size
        f = path.open("rb")
    except OSError as err:
        raise InvalidCheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    with f:
        r = _Reader(f, name, size)
        if f.read(4) != MAGIC:
            raise InvalidCheckpointError(f"{name} is not a GGUF file (no GGUF magic)")
        version = r.scalar("<I")
        if version not in (2, 3):
            raise InvalidCheckpointError(f"{name} is GGUF version {version}; only versions 2 and 3 are read")
        n_tensors, n_kv = r.count("tensor table"), r.count("metadata table")
        metadata = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.scalar("<I"))
        infos, seen = [], set()
        for _ in range(n_tensors):
            tensor_name, n_dims = r.string(), r.scalar("<I")
            if tensor_name in seen:  # the second would silently replace the first
                raise InvalidCheckpointError(f"{name} is corrupt: it names tensor '{tensor_name}' twice")
            seen.add(tensor_name)
            if not 1 <= n_dims <= MAX_DIMS:
                raise InvalidCheckpointError(f"{name}: tensor '{tensor_name}' has {n_dims} dimensions")
            dims = [r.scalar("<Q") for _ in range(n_dims)]
            if 0 in dims:  # no bytes to check against the file, and no model has an empty weight
                raise InvalidCheckpointError(
                    f"{name} is corrupt: tensor '{tensor_name}' has a zero-size dimension "
                    f"({' x '.join(map(str, reversed(dims)))})")
            infos.append((tensor_name, dims, r.scalar("<I"), r.scalar("<Q")))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise InvalidCheckpointError(f"{name} has an invalid general.alignment ({alignment!r})")
        data_start = -(-f.tell() // alignment) * alignment
    tensors = {}
    for tensor_name, dims, kind, offset in infos:
        if kind not in GGML_TYPES:
            raise InvalidCheckpointError(f"{name}: tensor '{tensor_name}' has unknown ggml type {kind}")
        type_name, block, block_bytes = GGML_TYPES[kind]
        elements = 1
        for d in dims:
            elements *= d
        if dims[0] % block:
            raise InvalidCheckpointError(
                f"{name}: tensor '{tensor_name}' ({type_name}) has rows of {dims[0]}, not a multiple of {block}")
        nbytes = elements // block * block_bytes
        start = data_start + offset
        if start + nbytes > size:
            raise InvalidCheckpointError(
                f"{name} is truncated or corrupt: tensor '{tensor_name}' ends at byte {start + nbytes:,} "
                f"but the file has {size:,}")
        tensors[tensor_name] = TensorInfo(tensor_name, tuple(reversed(dims)), type_name, start, nbytes)
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors)


def tensor_bytes(header: GGUFHeader, info: TensorInfo):
    """The raw bytes of one tensor as a read-only numpy uint8 array (memory-mapped)."""
    import numpy as np

    return np.memmap(header.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
