"""The CUDA sources of the verify attention kernel (``attention.py`` plans and launches them).

Pass 1 comes in three variants with one output layout (a partial softmax state per key chunk
and query vector); each reads each key and value of a chunk once for every query vector of
its tile:
- by queries (here): a block of NW warps stages each 32-key tile of its chunk in shared memory
  (as float); every warp scores the tile against its own QPW query vectors. Many query
  vectors (a wide verify over GQA heads) share each staged tile.
- by keys (``attention_keys.py``): each warp reads its own 32-key tiles of the chunk straight
  into registers and scores them against all of the block's query vectors, with no barrier
  inside the loop; the block merges its warps' states at the end. Faster while the query
  vectors are few (plain decoding, narrow verifies), slower when there are many.
- on tensor cores (``attention_mma.py``, bf16 and fp16): a block stages 64-key tiles of its
  chunk and its warps score and weigh them with ``mma.sync``, 16 query vectors a warp; for
  many query vectors, where the two above run on the CUDA cores.
Pass 2 (COMBINE) rescales and adds the chunks.
"""

from .attention_keys import PARTIAL_BY_KEYS
from .attention_mma import PARTIAL_BY_MMA
from .switch import compact

HEADER = compact("""
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

// Running softmax state of a lane for QPW query vectors: max and sum (its keys' share), and
// the unscaled output's EPL head dims.
template <int QPW, int EPL>
__device__ __forceinline__ void mlxspec_attn_init(float (&m)[QPW], float (&l)[QPW], float (&acc)[QPW][EPL]) {
    const float NEG_INF = __int_as_float(0xff800000);
    #pragma unroll
    for (int t = 0; t < QPW; ++t) {
        m[t] = NEG_INF;
        l[t] = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) {
            acc[t][e] = 0.0f;
        }
    }
}

// One 32-key tile's online-softmax step for one query vector: X is this lane's masked score.
// Raises the running max M to the tile's, rescales the lane's share of the sum L and its
// accumulators ACC by the change, and returns this lane's weight exp(x - max).
template <int EPL>
__device__ __forceinline__ float mlxspec_attn_online(float x, float& m, float& l, float* acc) {
    const float NEG_INF = __int_as_float(0xff800000);
    float tile_max = x;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, off));
    }
    const float m_new = fmaxf(m, tile_max);
    const float m_use = m_new == NEG_INF ? 0.0f : m_new;  // all -inf so far: no NaN
    const float alpha = expf(m - m_use);
    const float p = expf(x - m_use);
    l = l * alpha + p;
    m = m_new;
    #pragma unroll
    for (int e = 0; e < EPL; ++e) {
        acc[e] *= alpha;
    }
    return p;
}

// N contiguous elements of T to floats, in one load (4 or 8 bytes) or 16-byte loads; the
// source is aligned to min(16, N * sizeof(T)) bytes.
template <typename T, int Bytes> struct mlxspec_attn_vec;
template <typename T> struct mlxspec_attn_vec<T, 4> {
    __device__ static inline void load(const T* src, float* dst) {
        const unsigned int raw = *reinterpret_cast<const unsigned int*>(src);
        const T* v = reinterpret_cast<const T*>(&raw);
        #pragma unroll
        for (int i = 0; i < (int)(4 / sizeof(T)); ++i) {
            dst[i] = static_cast<float>(v[i]);
        }
    }
};
template <typename T> struct mlxspec_attn_vec<T, 8> {
    __device__ static inline void load(const T* src, float* dst) {
        const uint2 raw = *reinterpret_cast<const uint2*>(src);
        const T* v = reinterpret_cast<const T*>(&raw);
        #pragma unroll
        for (int i = 0; i < (int)(8 / sizeof(T)); ++i) {
            dst[i] = static_cast<float>(v[i]);
        }
    }
};
template <typename T> struct mlxspec_attn_vec<T, 16> {
    __device__ static inline void load(const T* src, float* dst) { mlxspec_attn_load16<T>(src, dst); }
};
template <typename T> struct mlxspec_attn_vec<T, 32> {
    __device__ static inline void load(const T* src, float* dst) {
        mlxspec_attn_load16<T>(src, dst);
        mlxspec_attn_load16<T>(src + 16 / sizeof(T), dst + 16 / sizeof(T));
    }
};
""")

# Pass 1, by queries. queries [B, Hq, L, D], keys / values [B, Hkv, S, D], any strides
# (elements); part_o [B * Hq * L, chunks, D], part_m / part_l [B * Hq * L, chunks] (float32).
# Grid: x = key chunk, y = tile of NW * QPW query vectors, z = batch * Hkv.
PARTIAL_BY_QUERIES = compact("""
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

    KV_HEAD_SHAPES  // Hq, L, Hkv, S, G, R (query vectors a KV head), n_chunks, chunk (snippets:
                    // attention_source.py)
    const int q0 = blockIdx.y * RT;
    BLOCK_THREAD  // b, kvh, tid, warp, lane
    KEY_CHUNK  // chunk_len, k_begin, k_end
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
    mlxspec_attn_init<QPW, EPL>(m_run, l_run, acc);
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
                p_s[(warp * QPW + t) * TK + lane] = mlxspec_attn_online<EPL>(x, m_run[t], l_run[t], acc[t]);
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
""")

# How a score is masked, per kind: x is the scaled score of key kj (by queries and by keys:
# k0 + lane) for query vector rg (by queries: q0 + warp + NW * t; by keys: q0 + t; on tensor
# cores: the lane's row h), row i of query head g of the KV head. A masked score is -FLT_MAX
# (MLX's finfo.min).
_ROWS = {"queries": "const int rg = q0 + warp + NW * t; const int g = rg / L; const int i = rg - g * L;"
                      " const int kj = k0 + lane;",
         "keys": "const int rg = q0 + t; const int g = rg / L; const int i = rg - g * L; const int kj = k0 + lane;",
         "mma": "const int rg = rq[h]; const int g = rg / L; const int i = rg - g * L;"}
_MASK_AT = ("mask[b * mask_strides[0] + (kvh * G + g) * mask_strides[1] + i * mask_strides[2]"
            " + (long long)kj * mask_strides[3]]")
_MASK_APPLY = {
    "none": "",
    # bottom-right aligned, as MLX's "causal": row i sees keys kj <= S - L + i
    "causal": " if (kj > S - L + i) { x = -3.402823466e+38f; }",
    "bool": f" if (!{_MASK_AT}) {{ x = -3.402823466e+38f; }}",
    "add": f" x += static_cast<float>({_MASK_AT});",
}
MASK_KINDS = tuple(_MASK_APPLY)
SPLITS = ("queries", "keys", "mma")


# Snippets every pass 1 shares, put in for their names in the sources. KV_HEAD_SHAPES: the
# call's shapes, the query vectors a KV head, the chunk count and this block's chunk.
_KV_HEAD_SHAPES = compact("""
    const int Hq = queries_shape[1];
    const int L = queries_shape[2];
    const int Hkv = keys_shape[1];
    const int S = keys_shape[2];
    const int G = Hq / Hkv;
    const int R = G * L;  // query vectors per KV head: row i of head kvh * G + g is g * L + i
    const int n_chunks = gridDim.x;
    const int chunk = blockIdx.x;
""").rstrip("\n")


# BLOCK_THREAD: the block's batch row and KV head, the thread's warp and lane.
_BLOCK_THREAD = compact("""
    const int b = blockIdx.z / Hkv;
    const int kvh = blockIdx.z - b * Hkv;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
""").rstrip("\n")
# KEY_CHUNK: the block's keys [k_begin, k_end), in whole 32-key tiles (attention.TILE), the
# split attention.chunks plans.
_KEY_CHUNK = compact("""
    const int chunk_len = ((S + n_chunks - 1) / n_chunks + 31) / 32 * 32;
    const int k_begin = chunk * chunk_len;
    const int k_end = min(S, k_begin + chunk_len);  // k_begin >= k_end: an empty chunk, m = -inf
""").rstrip("\n")


def partial_source(mask_kind: str, split: str) -> str:
    """Pass 1's body for a mask kind, its warps splitting the query vectors or the keys, or on
    tensor cores."""
    body = {"queries": PARTIAL_BY_QUERIES, "keys": PARTIAL_BY_KEYS, "mma": PARTIAL_BY_MMA}[split]
    apply = _MASK_APPLY[mask_kind]
    body = body.replace("KV_HEAD_SHAPES", _KV_HEAD_SHAPES).replace("BLOCK_THREAD", _BLOCK_THREAD)
    return body.replace("KEY_CHUNK", _KEY_CHUNK).replace("MASK_APPLY", _ROWS[split] + apply if apply else "")


# Pass 2. part_o [rows, chunks, D], part_m / part_l [rows, chunks] -> out [rows, D]; a warp a row.
COMBINE = compact("""
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
""")
