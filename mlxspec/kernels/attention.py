"""Verify attention for MLX's CUDA backend: 1..16 query rows over a KV cache.

MLX 0.32's CUDA ``mx.fast.scaled_dot_product_attention`` builds a new cuDNN graph for every
new (query rows, key length) it sees with more than one query row: 50-70 ms a call, and a
verify step's key length is new every step (the cache grows by the accepted tokens). One query
row (plain decoding) takes another path, which is fast at head_dim 128 and half this kernel's
speed at 256 (one H100, 32K keys: docs/benchmarks.md); it stays MLX's unless ONE_ROW_FROM_KEYS
says otherwise. This kernel's launch never depends on the key length, so it costs the same at
every step.

Flash-decoding in two launches (sources: ``attention_source.py``). Pass 1: one block per (key
chunk, tile of query vectors, batch x KV head); the query vectors are the L rows of the
G = Hq / Hkv query heads that share the KV head, so each key and value is read from memory once
for all of them. Its warps split the keys while a KV head has at most KEY_SPLIT_VECTORS query
vectors (plain decoding, narrow verifies: no barrier inside the loop, the keys read straight
into registers), and split the query vectors above that (a staged tile of keys serves many).
From TENSOR_CORE_VECTORS query vectors in bf16 or fp16, pass 1 runs on tensor cores instead
(``attention_mma.py``: 16 query vectors a warp, 64-key tiles staged with ``cp.async``).
Pass 2: one warp per (batch, query head, row) rescales and adds the chunks and writes the
output in the queries' dtype.

Keys and values are read through their strides (a ``KVCache`` hands out views of a larger
buffer; no copy is made); so are the queries and the mask (an array mask is broadcast to
[B, Hq, L, S] as a stride-0 view, never materialized).

Masked keys (bool mask False, or beyond the causal diagonal) score ``-FLT_MAX`` like
``finfo.min`` in MLX's reference path, so a row with every key masked gets the mean of the
values, as MLX's CPU path gives. An additive mask adds its values; a row whose keys are all
``-inf`` gives zeros here (MLX's CPU path gives NaN).
"""

from __future__ import annotations

import functools
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as _base

from ..compat import rebind
from . import attention_mma
from .attention_mask import DTYPES, kernel_mask, mask_kind
from .attention_source import COMBINE, HEADER, partial_source
from .switch import active

# mlx-lm's function, kept before anything rebinds the name: the fallback, and what install()
# recognizes in a model's module.
_mlx_lm_sdpa = _base.scaled_dot_product_attention

MIN_ROWS = 2  # one row (decoding) keeps MLX's kernel, which has no per-shape cost...
# ...except, for a head dim named here, over caches of at least this many keys, where this
# kernel is faster in whole forwards (timed on an H100: docs/benchmarks.md).
ONE_ROW_FROM_KEYS: dict[int, int] = {}
MAX_ROWS = 16
HEAD_DIMS = (64, 128, 256)

WARPS = 4  # warps per pass-1 block
TILE = 32  # keys a warp scores at once: one per lane
# Query vectors a KV head (G heads x L rows) up to which pass 1's warps split the keys. Timed on
# an H100 (docs/benchmarks.md): at 32K keys with the 8B shape's heads, 8 vectors took 0.16 ms
# split by keys against 0.23 ms split by queries, 16 about the same in whole forwards, and 32
# 0.67 ms against 0.29 ms.
KEY_SPLIT_VECTORS = 16
# Split by keys, the query vectors a block holds (registers: QPW x D/32 accumulators a lane):
# 8 or 16 for head dims up to 128, 8 for 256 (16 would spill).
KEY_SPLIT_TILES = {64: (8, 16), 128: (8, 16), 256: (8,)}
QUERIES_PER_WARP = 8  # split by queries: each warp's vectors; a block holds WARPS x 8
# Query vectors a KV head from which pass 1 runs on tensor cores (bf16 and fp16 only; float32
# keeps the splits above), 16 x 1, 2 or 4 vectors a block. Timed on an H200 (docs/benchmarks.md)
# from 8 vectors (2 rows of the 8B's heads) to 96: at 32K keys 0.066 ms for 8 vectors against
# 0.157 split by keys, 0.153 for 36 against 0.477 split by queries. Fewer than 8 (one row of
# GQA 4) were not timed and keep the keys split.
TENSOR_CORE_VECTORS = 8
TENSOR_CORE_DTYPES = (mx.bfloat16, mx.float16)
# Pass-1 blocks to aim for: about two per SM of a 132-SM GPU. Fewer chunks leave SMs idle
# at short key lengths; more only add partial outputs for pass 2 to read.
TARGET_BLOCKS = 264


def partial_inputs(mask_kind: str) -> list[str]:
    return ["queries", "keys", "values", "scale"] + (["mask"] if mask_kind in ("bool", "add") else [])


def shared_bytes(split: str, head_dim: int, qpw: int) -> int:
    """Pass 1's dynamic shared memory. By queries: the scaled queries, one tile of keys or
    values (as float), the weights. By keys: the scaled queries and each warp's weights for a
    tile, then (the same space) each warp's outputs, maxima and sums. On tensor cores (QPW:
    its m-tiles): :func:`.attention_mma.shared_bytes`."""
    if split == "mma":
        return attention_mma.shared_bytes(head_dim, qpw)
    if split == "queries":
        return 4 * (WARPS * qpw * head_dim + TILE * (head_dim + 4) + WARPS * qpw * TILE)
    return 4 * max(qpw * head_dim + WARPS * qpw * TILE, WARPS * qpw * (head_dim + 2))


def split_for(head_dim: int, vectors: int, tensor_cores: bool = False) -> tuple[str, int, int]:
    """How pass 1 takes VECTORS query vectors a KV head: (split, QPW or m-tiles, query vectors
    a block); TENSOR_CORES: the dtype has them (bf16, fp16)."""
    if tensor_cores and vectors >= TENSOR_CORE_VECTORS:
        tiles = attention_mma.m_tiles_for(vectors)
        return "mma", tiles, 16 * tiles
    if vectors > KEY_SPLIT_VECTORS:
        return "queries", QUERIES_PER_WARP, WARPS * QUERIES_PER_WARP
    tiles = KEY_SPLIT_TILES[head_dim]
    qpw = next((t for t in tiles if t >= vectors), tiles[-1])
    return "keys", qpw, qpw


@functools.cache
def _partial_kernel(mask_kind: str, split: str, head_dim: int, qpw: int):
    # One kernel object per split, head size and query tile: its shared memory is fixed at construction.
    return mx.fast.cuda_kernel(
        name=f"mlxspec_attn_partial_{split}_{mask_kind}", input_names=partial_inputs(mask_kind),
        output_names=["part_o", "part_m", "part_l"], header=attention_mma.HEADER_MMA if split == "mma" else HEADER,
        source=partial_source(mask_kind, split),
        ensure_row_contiguous=False,  # the cache's K/V views are read in place
        shared_memory=shared_bytes(split, head_dim, qpw))


@functools.cache
def _combine_kernel():
    return mx.fast.cuda_kernel(name="mlxspec_attn_combine", input_names=["part_o", "part_m", "part_l"],
                               output_names=["out"], source=COMBINE)


@functools.lru_cache(maxsize=64)
def _scalar(value: float) -> mx.array:
    """The softmax scale as a kept float32 array (a model uses one; no copy per call)."""
    arr = mx.array([value], dtype=mx.float32)
    mx.eval(arr)
    return arr


def chunks(S: int, blocks_per_chunk: int, tiles: int = 1) -> int:
    """Key chunks for pass 1: enough blocks to fill the GPU, at least TILES tiles of keys each
    where the keys allow (split by keys: one for each warp), none empty. The kernel recomputes
    the chunk length from this count (ceil(S / n) in whole tiles), which gives the same split."""
    n = max(1, min(-(-S // (TILE * tiles)), -(-TARGET_BLOCKS // blocks_per_chunk)))
    length = -(-(-(-S // n)) // TILE) * TILE
    return -(-S // length)


def verify_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """softmax(q k^T * scale + mask) v by the kernel, for q [B, Hq, L, D] (1 <= L <= MAX_ROWS),
    k, v [B, Hkv, S, D]; always the kernel (CUDA only), whatever :func:`active` says."""
    why = unsupported(q, k, v, mask)
    if why:
        raise ValueError(f"verify_attention: {why}")
    return attend(q, k, v, scale, mask)


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    """:func:`verify_attention` on inputs already checked (the dispatcher's path)."""
    qs, S = q.shape, k.shape[2]
    array_mask = not (mask is None or isinstance(mask, str))
    partial, template, blocks, tiles, grid_yz, rows, combine = _plan(
        qs, k.shape[1], q.dtype, mask if not array_mask else None, mask.dtype if array_mask else None)
    inputs = [q, k, v, _scalar(float(scale))]
    if array_mask:
        inputs.append(kernel_mask(mask, (*qs[:3], S)))
    n = chunks(S, blocks, tiles)
    parts = partial(inputs=inputs, template=template, grid=(32 * WARPS * n, *grid_yz), threadgroup=(32 * WARPS, 1, 1),
                    output_shapes=[(rows, n, qs[3]), (rows, n), (rows, n)], output_dtypes=[mx.float32] * 3)
    return _combine_kernel()(inputs=parts, output_shapes=[qs], output_dtypes=[q.dtype], **combine)[0]


@functools.lru_cache(maxsize=256)
def _plan(qs: tuple, Hkv: int, dtype, mask: str | None, mask_dtype) -> tuple:
    """What a verify's launches need that its key length does not change, made once a shape
    (a verify pays for host time on CUDA): the pass-1 kernel, its template, blocks a key chunk,
    the tiles a chunk should have, grid y and z, output rows, and pass 2's launch."""
    B, Hq, L, D = qs
    kind = mask or ("none" if mask_dtype is None else "bool" if mask_dtype == mx.bool_ else "add")
    vectors = Hq // Hkv * L
    split, qpw, per_block = split_for(D, vectors, dtype in TENSOR_CORE_DTYPES)
    template = [("T", dtype), ("D", D), ("NW", WARPS), ("MT" if split == "mma" else "QPW", qpw)]
    if kind == "add":
        template.append(("MaskT", mask_dtype))
    q_tiles = -(-vectors // per_block)
    rows = B * Hq * L
    combine = {"template": [("T", dtype), ("D", D)], "grid": (32 * rows, 1, 1), "threadgroup": (128, 1, 1)}
    tiles = {"keys": WARPS, "mma": attention_mma.TILE_KEYS // TILE}.get(split, 1)
    return (_partial_kernel(kind, split, D, qpw), template, q_tiles * B * Hkv, tiles,
            (q_tiles, B * Hkv), rows, combine)


def unsupported(q, k, v, mask) -> str | None:
    """Why the kernel cannot take these inputs (None: it can); it has one T for all three."""
    if not all(isinstance(x, mx.array) and x.ndim == 4 for x in (q, k, v)):
        return "queries, keys and values must be 4-D arrays"
    qs, ks, vs = q.shape, k.shape, v.shape
    B, Hq, L, D = qs
    Hkv, S = ks[1], ks[2]
    if not 1 <= L <= MAX_ROWS or D not in HEAD_DIMS or Hq % Hkv or ks != vs \
            or ks[0] != B or ks[3] != D or S < 1:
        return f"unsupported shapes q {qs}, k {ks}, v {vs}"
    dtype = q.dtype
    if dtype not in DTYPES or k.dtype != dtype or v.dtype != dtype:
        return f"unsupported dtypes {dtype}, {k.dtype}, {v.dtype}"
    if mask_kind(mask, (B, Hq, L, S)) is None:
        return f"unsupported mask {mask!r}"
    return None


def eligible(queries, keys, values, cache, mask, sinks) -> bool:
    """What the dispatcher sends to the kernel: at least MIN_ROWS query rows (one row keeps
    MLX's decode kernel unless ONE_ROW_FROM_KEYS names its head dim and the cache is that long,
    and is asked about first: it costs next to nothing more than mlx-lm's call) or one row under
    an array mask (a batch's plain step over rows of different lengths, which MLX's decode
    kernel does not take: MLX ran it as 5 ops a layer, 1.46 ms of an 8.2 ms 4-row forward of the
    8B shape on an H100 by ncu, docs/benchmarks.md), plain float
    K/V (not a quantized cache), no sinks, the kernels active, and inputs the kernel takes."""
    if queries.shape[2] < MIN_ROWS and (mask is None or isinstance(mask, str)):
        from_keys = ONE_ROW_FROM_KEYS.get(queries.shape[3])
        if from_keys is None or keys.shape[2] < from_keys:
            return False
    if sinks is not None or hasattr(cache, "bits") or not active():
        return False
    return unsupported(queries, keys, values, mask) is None


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's ``base.scaled_dot_product_attention`` (same signature): the kernel for a verify
    step on CUDA, mlx-lm's own function for everything else and when the kernels are off."""
    if eligible(queries, keys, values, cache, mask, sinks):
        return attend(queries, keys, values, scale, mask)
    return _mlx_lm_sdpa(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install(model: nn.Module) -> int:
    """Point every module a model's layers come from (qwen3, qwen3_next for qwen3_5, llama, ...)
    at :func:`scaled_dot_product_attention` where it imported mlx-lm's. Safe to leave in: it
    falls back to mlx-lm's function whenever the kernel is off. Returns how many modules use it."""
    seen: set[str] = set()
    rebound = 0
    for m in model.modules():
        name = type(m).__module__
        if name in seen:
            continue
        seen.add(name)
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) in (_mlx_lm_sdpa, scaled_dot_product_attention):
            rebind(module, "scaled_dot_product_attention", scaled_dot_product_attention)
            rebound += 1
    return rebound
