"""Verify attention for MLX's CUDA backend: 2..16 query rows over a KV cache.

MLX 0.32's CUDA ``mx.fast.scaled_dot_product_attention`` builds a new cuDNN graph for every
new (query rows, key length) it sees with more than one query row: 50-70 ms a call, and a
verify step's key length is new every step (the cache grows by the accepted tokens). One query
row (plain decoding) takes another path and is fine. This kernel's launch never depends on the
key length, so it costs the same at every step.

Flash-decoding in two launches. Pass 1: one block per (key chunk, tile of up to 32 query
vectors, batch x KV head); the query vectors are the L rows of the G = Hq / Hkv query heads that
share the KV head, so each key and value of the chunk is read from memory once per block for
all of them. A block stages 32 keys at a time in shared memory (as float), each lane scores one
key against the warp's query vectors, keeps an online softmax (running max, sum and unscaled
output, float32) and writes them per chunk. Pass 2: one warp per (batch, query head, row)
rescales and adds the chunks and writes the output in the queries' dtype.

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
from .attention_mask import DTYPES, kernel_mask, mask_kind
from .switch import active, compact

# mlx-lm's function, kept before anything rebinds the name: the fallback, and what install()
# recognizes in a model's module.
_mlx_lm_sdpa = _base.scaled_dot_product_attention

MIN_ROWS = 2  # one row (decoding) keeps MLX's kernel, which has no per-shape cost
MAX_ROWS = 16
HEAD_DIMS = (64, 128, 256)

WARPS = 4  # warps per pass-1 block
QUERIES_PER_WARP = 8  # query vectors per warp (registers: 8 x D/32 accumulators a lane)
TILE = 32  # keys staged per step: one per lane while scoring
QUERY_TILE = WARPS * QUERIES_PER_WARP
# Pass-1 blocks to aim for: about two per SM of a 132-SM GPU. Fewer chunks leave SMs idle
# at short key lengths; more only add partial outputs for pass 2 to read.
TARGET_BLOCKS = 264

_HEADER = """
template <typename T>
__device__ inline void mlxspec_attn_load16(const T* src, float* dst) {
    // 16 bytes of T (16-byte aligned) to 16 / sizeof(T) floats
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* v = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int i = 0; i < (int)(16 / sizeof(T)); ++i) {
        dst[i] = static_cast<float>(v[i]);
    }
}

// N floats (N = D / 32 head dims of a lane) from suitably aligned shared memory
template <int N> __device__ inline void mlxspec_attn_lds(const float* p, float* out);
template <> __device__ inline void mlxspec_attn_lds<2>(const float* p, float* out) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    out[0] = x.x; out[1] = x.y;
}
template <> __device__ inline void mlxspec_attn_lds<4>(const float* p, float* out) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
}
template <> __device__ inline void mlxspec_attn_lds<8>(const float* p, float* out) {
    mlxspec_attn_lds<4>(p, out);
    mlxspec_attn_lds<4>(p + 4, out + 4);
}

// Rows k0 .. k0 + 31 of one (batch, KV head) of keys or values into shared memory as float
// ([32][Row]); rows past the chunk are zeros, so no stale value meets a zero weight as NaN.
template <typename T, int D, int Row, int Threads>
__device__ inline void mlxspec_attn_load_tile(float* dst, const T* src, long long s_stride,
                                              long long d_stride, int k0, int n_keys, int tid) {
    constexpr int VE = 16 / sizeof(T);
    constexpr int PIECES = D / VE;  // 16-byte pieces per row
    const bool vec = d_stride == 1 && s_stride % VE == 0
        && reinterpret_cast<unsigned long long>(src) % 16 == 0;  // the same for the whole block
    if (vec) {
        for (int c = tid; c < 32 * PIECES; c += Threads) {
            const int j = c / PIECES;
            const int col = (c - j * PIECES) * VE;
            float vals[VE];
            if (j < n_keys) {
                mlxspec_attn_load16<T>(src + (long long)(k0 + j) * s_stride + col, vals);
            } else {
                #pragma unroll
                for (int i = 0; i < VE; ++i) {
                    vals[i] = 0.0f;
                }
            }
            float4* out = reinterpret_cast<float4*>(dst + j * Row + col);
            #pragma unroll
            for (int i = 0; i < VE / 4; ++i) {
                out[i] = make_float4(vals[4 * i], vals[4 * i + 1], vals[4 * i + 2], vals[4 * i + 3]);
            }
        }
    } else {
        for (int e = tid; e < 32 * D; e += Threads) {
            const int j = e / D;
            const int d = e - j * D;
            dst[j * Row + d] = j < n_keys
                ? static_cast<float>(src[(long long)(k0 + j) * s_stride + (long long)d * d_stride]) : 0.0f;
        }
    }
}
"""

# Pass 1. queries [B, Hq, L, D], keys / values [B, Hkv, S, D], any strides (elements);
# part_o [B * Hq * L, chunks, D], part_m / part_l [B * Hq * L, chunks] (float32).
# Grid: x = key chunk, y = tile of query vectors, z = batch * Hkv.
_PARTIAL = """
    constexpr int TK = 32;
    constexpr int RT = NW * QPW;
    constexpr int EPL = D / 32;  // head dims per lane when accumulating
    constexpr int ROW = D + 4;   // padded: lane j reads row j, and rows 16 bytes apart skip banks
    constexpr int THREADS = NW * 32;
    const float NEG_INF = __int_as_float(0xff800000);
    extern __shared__ float4 mlxspec_attn_smem[];
    float* q_s = reinterpret_cast<float*>(mlxspec_attn_smem);  // [RT][D], scaled
    float* kv_s = q_s + RT * D;                                 // [TK][ROW]: keys, then values
    float* p_s = kv_s + TK * ROW;                               // [NW][QPW][TK] weights

    const int Hq = queries_shape[1];
    const int L = queries_shape[2];
    const int Hkv = keys_shape[1];
    const int S = keys_shape[2];
    const int G = Hq / Hkv;
    const int R = G * L;  // query vectors per KV head: row i of head kvh * G + g is g * L + i
    const int n_chunks = gridDim.x;
    const int chunk = blockIdx.x;
    const int q0 = blockIdx.y * RT;
    const int b = blockIdx.z / Hkv;
    const int kvh = blockIdx.z - b * Hkv;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int chunk_len = ((S + n_chunks - 1) / n_chunks + TK - 1) / TK * TK;
    const int k_begin = chunk * chunk_len;
    const int k_end = min(S, k_begin + chunk_len);  // k_begin >= k_end: an empty chunk, m = -inf
    // this warp's query vectors: q0 + warp + NW * t for t < nq (the same on all its lanes)
    const int nq = max(0, min(QPW, (R - q0 - warp + NW - 1) / NW));
    const float sc = scale[0];

    for (int e = tid; e < RT * D; e += THREADS) {
        const int r = e / D;
        const int d = e - r * D;
        const int rg = q0 + r;
        float x = 0.0f;
        if (rg < R) {
            const int g = rg / L;
            const int i = rg - g * L;
            x = static_cast<float>(queries[b * queries_strides[0] + (kvh * G + g) * queries_strides[1]
                                           + i * queries_strides[2] + d * queries_strides[3]]) * sc;
        }
        q_s[e] = x;
    }

    float m_run[QPW];
    float l_run[QPW];  // this lane's share of the sum (its keys); added across lanes at the end
    float acc[QPW][EPL];
    #pragma unroll
    for (int t = 0; t < QPW; ++t) {
        m_run[t] = NEG_INF;
        l_run[t] = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) {
            acc[t][e] = 0.0f;
        }
    }
    const T* k_src = keys + b * keys_strides[0] + kvh * keys_strides[1];
    const T* v_src = values + b * values_strides[0] + kvh * values_strides[1];

    for (int k0 = k_begin; k0 < k_end; k0 += TK) {
        const int n_keys = min(TK, k_end - k0);
        __syncthreads();  // every warp is done with the previous tile's values
        mlxspec_attn_load_tile<T, D, ROW, THREADS>(kv_s, k_src, keys_strides[2], keys_strides[3], k0, n_keys, tid);
        __syncthreads();

        float s[QPW];
        #pragma unroll
        for (int t = 0; t < QPW; ++t) {
            s[t] = 0.0f;
        }
        const float4* k_row = reinterpret_cast<const float4*>(kv_s + lane * ROW);
        #pragma unroll 4
        for (int c = 0; c < D / 4; ++c) {
            const float4 kk = k_row[c];
            #pragma unroll
            for (int t = 0; t < QPW; ++t) {
                if (t < nq) {
                    const float4 qq = reinterpret_cast<const float4*>(q_s + (warp + NW * t) * D)[c];
                    s[t] += kk.x * qq.x + kk.y * qq.y + kk.z * qq.z + kk.w * qq.w;
                }
            }
        }

        #pragma unroll
        for (int t = 0; t < QPW; ++t) {
            if (t < nq) {
                float x = s[t];
                if (lane < n_keys) {
                    MASK_APPLY
                } else {
                    x = NEG_INF;  // not a key: no weight even in a fully masked row
                }
                float tile_max = x;
                #pragma unroll
                for (int off = 16; off > 0; off >>= 1) {
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, off));
                }
                const float m_new = fmaxf(m_run[t], tile_max);
                const float m_use = m_new == NEG_INF ? 0.0f : m_new;  // all -inf so far: no NaN
                const float alpha = expf(m_run[t] - m_use);
                const float p = expf(x - m_use);
                l_run[t] = l_run[t] * alpha + p;
                m_run[t] = m_new;
                p_s[(warp * QPW + t) * TK + lane] = p;
                #pragma unroll
                for (int e = 0; e < EPL; ++e) {
                    acc[t][e] *= alpha;
                }
            }
        }

        __syncthreads();  // every warp is done with the keys
        mlxspec_attn_load_tile<T, D, ROW, THREADS>(kv_s, v_src, values_strides[2], values_strides[3], k0, n_keys, tid);
        __syncthreads();

        for (int j = 0; j < n_keys; ++j) {
            float v[EPL];
            mlxspec_attn_lds<EPL>(kv_s + j * ROW + lane * EPL, v);
            #pragma unroll
            for (int t = 0; t < QPW; ++t) {
                if (t < nq) {
                    const float p = p_s[(warp * QPW + t) * TK + j];
                    #pragma unroll
                    for (int e = 0; e < EPL; ++e) {
                        acc[t][e] += p * v[e];
                    }
                }
            }
        }
    }

    #pragma unroll
    for (int t = 0; t < QPW; ++t) {
        if (t < nq) {
            float l_sum = l_run[t];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                l_sum += __shfl_xor_sync(0xffffffff, l_sum, off);
            }
            const int rg = q0 + warp + NW * t;
            const int g = rg / L;
            const int i = rg - g * L;
            const long long slot = (((long long)b * Hq + kvh * G + g) * L + i) * n_chunks + chunk;
            if (lane == 0) {
                part_m[slot] = m_run[t];
                part_l[slot] = l_sum;
            }
            #pragma unroll
            for (int e = 0; e < EPL; ++e) {
                part_o[slot * D + lane * EPL + e] = acc[t][e];
            }
        }
    }
"""

# How a score is masked, per kind: x is the scaled score of key kj = k0 + lane for query vector
# rg = q0 + warp + NW * t, row i of query head h. A masked score is -FLT_MAX (MLX's finfo.min).
_ROW = "const int rg = q0 + warp + NW * t; const int g = rg / L; const int i = rg - g * L;"
_MASK_AT = ("mask[b * mask_strides[0] + (kvh * G + g) * mask_strides[1] + i * mask_strides[2]"
            " + (long long)(k0 + lane) * mask_strides[3]]")
_MASK_APPLY = {
    "none": "",
    # bottom-right aligned, as MLX's "causal": row i sees keys kj <= S - L + i
    "causal": _ROW + " if (k0 + lane > S - L + i) { x = -3.402823466e+38f; }",
    "bool": _ROW + f" if (!{_MASK_AT}) {{ x = -3.402823466e+38f; }}",
    "add": _ROW + f" x += static_cast<float>({_MASK_AT});",
}
MASK_KINDS = tuple(_MASK_APPLY)

# Pass 2. part_o [rows, chunks, D], part_m / part_l [rows, chunks] -> out [rows, D]; a warp a row.
_COMBINE = """
    constexpr int EPL = D / 32;
    const float NEG_INF = __int_as_float(0xff800000);
    const int rows = part_m_shape[0];
    const int n_chunks = part_m_shape[1];
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;  // whole warps only
    }
    const float* pm = part_m + (long long)row * n_chunks;
    const float* pl = part_l + (long long)row * n_chunks;
    const float* po = part_o + (long long)row * n_chunks * D + lane * EPL;
    float m = NEG_INF;
    for (int c = lane; c < n_chunks; c += 32) {
        m = fmaxf(m, pm[c]);
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
    }
    const float m_use = m == NEG_INF ? 0.0f : m;
    float acc[EPL];
    #pragma unroll
    for (int e = 0; e < EPL; ++e) {
        acc[e] = 0.0f;
    }
    float total = 0.0f;
    for (int c = 0; c < n_chunks; ++c) {
        const float w = expf(pm[c] - m_use);  // an empty or all -inf chunk: 0
        total += w * pl[c];
        #pragma unroll
        for (int e = 0; e < EPL; ++e) {
            acc[e] += w * po[(long long)c * D + e];
        }
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    #pragma unroll
    for (int e = 0; e < EPL; ++e) {
        out[(long long)row * D + lane * EPL + e] = static_cast<T>(acc[e] * inv);
    }
"""
# what MLX gets: the code without its comments (every call's node carries a copy)
_HEADER, _PARTIAL, _COMBINE = compact(_HEADER), compact(_PARTIAL), compact(_COMBINE)


def partial_source(mask_kind: str) -> str:
    return _PARTIAL.replace("MASK_APPLY", _MASK_APPLY[mask_kind])


def partial_inputs(mask_kind: str) -> list[str]:
    return ["queries", "keys", "values", "scale"] + (["mask"] if mask_kind in ("bool", "add") else [])


def shared_bytes(head_dim: int) -> int:
    """Pass 1's dynamic shared memory: scaled queries, one tile of keys or values, weights."""
    return 4 * (QUERY_TILE * head_dim + TILE * (head_dim + 4) + WARPS * QUERIES_PER_WARP * TILE)


@functools.cache
def _partial_kernel(mask_kind: str, head_dim: int):
    # One kernel object per head size: the shared memory size is fixed at construction.
    return mx.fast.cuda_kernel(
        name=f"mlxspec_attn_partial_{mask_kind}", input_names=partial_inputs(mask_kind),
        output_names=["part_o", "part_m", "part_l"], header=_HEADER, source=partial_source(mask_kind),
        ensure_row_contiguous=False,  # the cache's K/V views are read in place
        shared_memory=shared_bytes(head_dim))


@functools.cache
def _combine_kernel():
    return mx.fast.cuda_kernel(name="mlxspec_attn_combine", input_names=["part_o", "part_m", "part_l"],
                               output_names=["out"], source=_COMBINE)


@functools.lru_cache(maxsize=64)
def _scalar(value: float) -> mx.array:
    """The softmax scale as a kept float32 array (a model uses one; no copy per call)."""
    arr = mx.array([value], dtype=mx.float32)
    mx.eval(arr)
    return arr


def chunks(S: int, blocks_per_chunk: int) -> int:
    """Key chunks for pass 1: enough blocks to fill the GPU, at least a tile of keys each, none
    empty. The kernel recomputes the chunk length from this count (ceil(S / n) in whole
    tiles), which gives the same split."""
    n = max(1, min(-(-S // TILE), -(-TARGET_BLOCKS // blocks_per_chunk)))
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
    partial, template, blocks, grid_yz, rows, combine = _plan(qs, k.shape[1], q.dtype, mask if not array_mask
                                                              else None, mask.dtype if array_mask else None)
    inputs = [q, k, v, _scalar(float(scale))]
    if array_mask:
        inputs.append(kernel_mask(mask, (*qs[:3], S)))
    n = chunks(S, blocks)
    parts = partial(inputs=inputs, template=template, grid=(32 * WARPS * n, *grid_yz), threadgroup=(32 * WARPS, 1, 1),
                    output_shapes=[(rows, n, qs[3]), (rows, n), (rows, n)], output_dtypes=[mx.float32] * 3)
    return _combine_kernel()(inputs=parts, output_shapes=[qs], output_dtypes=[q.dtype], **combine)[0]


@functools.lru_cache(maxsize=256)
def _plan(qs: tuple, Hkv: int, dtype, mask: str | None, mask_dtype) -> tuple:
    """What a verify's launches need that its key length does not change, made once a shape
    (a verify pays for host time on CUDA): the pass-1 kernel, its template, blocks a key chunk,
    grid y and z, output rows, and pass 2's launch."""
    B, Hq, L, D = qs
    kind = mask or ("none" if mask_dtype is None else "bool" if mask_dtype == mx.bool_ else "add")
    template = [("T", dtype), ("D", D), ("NW", WARPS), ("QPW", QUERIES_PER_WARP)]
    if kind == "add":
        template.append(("MaskT", mask_dtype))
    q_tiles = -(-(Hq // Hkv) * L // QUERY_TILE)
    rows = B * Hq * L
    combine = {"template": [("T", dtype), ("D", D)], "grid": (32 * rows, 1, 1), "threadgroup": (128, 1, 1)}
    return _partial_kernel(kind, D), template, q_tiles * B * Hkv, (q_tiles, B * Hkv), rows, combine


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
    MLX's decode kernel, and is asked about first: it costs next to nothing more than mlx-lm's
    call), plain float K/V (not a quantized cache), no sinks, the kernels active, and inputs
    the kernel takes."""
    if queries.shape[2] < MIN_ROWS or sinks is not None or hasattr(cache, "bits") or not active():
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
