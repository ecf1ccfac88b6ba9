"""Pass 1 of the verify attention kernel on tensor cores (see ``attention_source.py``): the
variant for many query vectors a KV head in bf16 or fp16 (a verify of 5 or more rows over
GQA heads), where the other two score on the CUDA cores and slow as the vectors grow.

queries [B, Hq, L, D], keys / values [B, Hkv, S, D] of T (``__nv_bfloat16`` or ``__half``),
any strides (elements); part_o [B * Hq * L, chunks, D], part_m / part_l [B * Hq * L, chunks]
(float32), as the other variants write them. Grid: x = key chunk, y = tile of 16 x MT query
vectors, z = batch * Hkv; NW = 4 warps a block.

A block stages its query vectors once (as T, unscaled) and each 64-key tile of its chunk, keys
and values, in shared memory with ``cp.async``, two tiles in flight. Warp w takes m-tile
w % MT (16 query vectors) and key group w / MT of the tile (64 / KG keys, KG = NW / MT), and
computes with ``mma.sync.m16n8k16``:
- scores S = Q K^T (16 x 64 / KG, float32), then scaled, masked and folded into the warp's
  online softmax (running max and sum of each row, float32);
- O += P V with P = exp(S - max) rounded to T (as flash attention does), O float32.
The warps of one m-tile merge their states at the end (through shared memory) and write one
partial per chunk. Q's A fragments and K's B fragments come from ``ldmatrix``; V's B fragments
from ``ldmatrix.trans`` (V is [keys, dims] and the mma wants it k-major).

A row's result does not depend on the other query vectors of its tile (each row's scores,
softmax and sums are its own), so a token's attention is the same in a verify of any width
with the same chunks.
"""

from .mma import MMA16816
from .switch import compact

TILE_KEYS = 64  # keys a block stages at once (a 16-key mma k-step per warp at the least)
TILES = (1, 2, 4)  # MT, m-tiles a block: 16, 32 or 64 query vectors

HEADER_MMA = compact(MMA16816 + """
// Two floats to one register of two halves of T, the first in the low 16 bits.
template <typename T> __device__ inline uint32_t mlxspec_pack2(float lo, float hi);
template <> __device__ inline uint32_t mlxspec_pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ inline uint32_t mlxspec_pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Four 8 x 8 matrices of halves from shared memory: lane i gives the address of row i % 8 of
// matrix i / 8 (16 bytes); lane l receives, of matrix j, register r[j] = (row l / 4, columns
// 2 (l % 4) ..), or with TRANS (rows 2 (l % 4) .., column l / 4).
template <bool TRANS>
__device__ inline void mlxspec_ldsm4(uint32_t* r, const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    }
}

// 16 bytes global -> shared without registers; FULL false writes zeros (nothing is read).
__device__ inline void mlxspec_cp16(void* dst, const void* src, bool full) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    const int n = full ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(a), "l"(src), "r"(n));
}
__device__ inline void mlxspec_cp_commit() { asm volatile("cp.async.commit_group;\\n" ::); }
template <int N> __device__ inline void mlxspec_cp_wait() { asm volatile("cp.async.wait_group %0;\\n" :: "n"(N)); }

// Rows k0 .. k0 + TK - 1 of one (batch, KV head) of keys or values into shared memory
// ([TK][ROW] of T); rows at or past N_KEYS are zeros, so no stale value meets a zero weight as
// NaN. Vectorized: 16-byte cp.async (waited for by the caller); else plain loads.
template <typename T, int D, int ROW, int TK, int THREADS>
__device__ inline void mlxspec_mma_tile(T* dst, const T* src, long long s_stride, long long d_stride, bool vec,
                                        int k0, int n_keys, int tid) {
    constexpr int PIECES = D / 8;
    if (vec) {
        for (int c = tid; c < TK * PIECES; c += THREADS) {
            const int j = c / PIECES;
            const int col = (c - j * PIECES) * 8;
            const bool in = j < n_keys;
            mlxspec_cp16(dst + j * ROW + col, in ? src + (long long)(k0 + j) * s_stride + col : src, in);
        }
    } else {
        for (int e = tid; e < TK * D; e += THREADS) {
            const int j = e / D;
            const int d = e - j * D;
            dst[j * ROW + d] = j < n_keys ? src[(long long)(k0 + j) * s_stride + (long long)d * d_stride]
                                          : static_cast<T>(0.0f);
        }
    }
}
""")

PARTIAL_BY_MMA = compact("""
    constexpr int TK = TILE_KEYS;          // keys a block stages at once
    constexpr int ROW = D + 8;             // padded row (halves): ldmatrix rows 16 bytes apart skip banks
    constexpr int THREADS = NW * 32;
    constexpr int KG = NW / MT;            // warps sharing an m-tile, each its own keys of a tile
    constexpr int KW = TK / KG;            // keys a warp scores a tile
    constexpr int SN = KW / 8;             // its score n-tiles (8 keys each)
    constexpr int DN = D / 8;              // output n-tiles (8 head dims each)
    constexpr int NE = DN * 4 + 4;         // floats a lane hands over when warps merge
    const float NEG_INF = __int_as_float(0xff800000);
    extern __shared__ float4 mlxspec_attn_smem[];
    T* q_s = reinterpret_cast<T*>(mlxspec_attn_smem);  // [16 MT][ROW] queries
    T* kv_s = q_s + 16 * MT * ROW;                     // [2 stages][keys, values][TK][ROW]

    KV_HEAD_SHAPES  // Hq, L, Hkv, S, G, R (query vectors a KV head), n_chunks, chunk (snippets:
                    // attention_source.py)
    const int q0 = blockIdx.y * 16 * MT;
    BLOCK_THREAD  // b, kvh, tid, warp, lane
    const int grp = lane / 4;              // mma group: rows grp and grp + 8, key / dim column grp
    const int tig = lane % 4;              // lane in group: columns 2 tig, 2 tig + 1
    const int mt = warp % MT;
    const int kgw = warp / MT;
    const bool busy = q0 + 16 * mt < R;    // the m-tile holds a query vector
    KEY_CHUNK  // chunk_len, k_begin, k_end
    const float sc = scale[0];

    for (int e = tid; e < 16 * MT * D; e += THREADS) {
        const int r = e / D;
        const int d = e - r * D;
        const int rg = q0 + r;
        T x = static_cast<T>(0.0f);
        if (rg < R) {
            const int g = rg / L;
            const int i = rg - g * L;
            x = queries[b * queries_strides[0] + (kvh * G + g) * queries_strides[1] + i * queries_strides[2]
                        + d * queries_strides[3]];
        }
        q_s[r * ROW + d] = x;
    }
    // this lane's two rows (grp, grp + 8): vectors past R read row R - 1's mask and write nothing
    int rq[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        rq[h] = min(q0 + 16 * mt + grp + 8 * h, R - 1);
    }

    const T* k_src = keys + b * keys_strides[0] + kvh * keys_strides[1];
    const T* v_src = values + b * values_strides[0] + kvh * values_strides[1];
    const bool k_vec = keys_strides[3] == 1 && keys_strides[2] % 8 == 0
        && reinterpret_cast<unsigned long long>(k_src) % 16 == 0;  // the same for the whole block
    const bool v_vec = values_strides[3] == 1 && values_strides[2] % 8 == 0
        && reinterpret_cast<unsigned long long>(v_src) % 16 == 0;

    float m_run[2] = {NEG_INF, NEG_INF};
    float l_run[2] = {0.0f, 0.0f};  // this lane's share of each row's sum (its columns)
    float o[DN][4];
    #pragma unroll
    for (int n = 0; n < DN; ++n) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
            o[n][c] = 0.0f;
        }
    }

    const int n_tiles = k_end > k_begin ? (k_end - k_begin + TK - 1) / TK : 0;
    if (n_tiles > 0) {
        const int n_keys = min(TK, k_end - k_begin);
        mlxspec_mma_tile<T, D, ROW, TK, THREADS>(kv_s, k_src, keys_strides[2], keys_strides[3], k_vec,
                                                 k_begin, n_keys, tid);
        mlxspec_mma_tile<T, D, ROW, TK, THREADS>(kv_s + TK * ROW, v_src, values_strides[2], values_strides[3],
                                                 v_vec, k_begin, n_keys, tid);
        mlxspec_cp_commit();
    }
    for (int it = 0; it < n_tiles; ++it) {
        const int k0 = k_begin + it * TK;
        if (it + 1 < n_tiles) {  // the next tile streams in while this one is scored
            T* next = kv_s + ((it + 1) & 1) * 2 * TK * ROW;
            const int n_next = min(TK, k_end - k0 - TK);
            mlxspec_mma_tile<T, D, ROW, TK, THREADS>(next, k_src, keys_strides[2], keys_strides[3], k_vec,
                                                     k0 + TK, n_next, tid);
            mlxspec_mma_tile<T, D, ROW, TK, THREADS>(next + TK * ROW, v_src, values_strides[2], values_strides[3],
                                                     v_vec, k0 + TK, n_next, tid);
            mlxspec_cp_commit();
            mlxspec_cp_wait<1>();
        } else {
            mlxspec_cp_wait<0>();
        }
        __syncthreads();  // this tile (and the queries) are in shared memory for every warp
        if (busy) {
            const T* k_t = kv_s + (it & 1) * 2 * TK * ROW + kgw * KW * ROW;
            const T* v_t = k_t + TK * ROW;
            float s[SN][4];
            #pragma unroll
            for (int n = 0; n < SN; ++n) {
                #pragma unroll
                for (int c = 0; c < 4; ++c) {
                    s[n][c] = 0.0f;
                }
            }
            #pragma unroll
            for (int dk = 0; dk < D / 16; ++dk) {
                uint32_t a[4];
                mlxspec_ldsm4<false>(a, q_s + (16 * mt + lane % 16) * ROW + dk * 16 + (lane / 16) * 8);
                #pragma unroll
                for (int n = 0; n < SN; n += 2) {
                    uint32_t bk[4];
                    mlxspec_ldsm4<false>(bk, k_t + (n * 8 + (lane / 16) * 8 + lane % 8) * ROW + dk * 16
                                             + ((lane / 8) % 2) * 8);
                    mma16816<T>(s[n], a, bk[0], bk[1]);
                    mma16816<T>(s[n + 1], a, bk[2], bk[3]);
                }
            }
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float tile_max = NEG_INF;
                #pragma unroll
                for (int n = 0; n < SN; ++n) {
                    #pragma unroll
                    for (int c = 2 * h; c < 2 * h + 2; ++c) {
                        const int kj = k0 + kgw * KW + n * 8 + 2 * tig + (c & 1);
                        float x = s[n][c] * sc;
                        if (kj < k_end) {
                            MASK_APPLY
                        } else {
                            x = NEG_INF;  // not a key: no weight even in a fully masked row
                        }
                        s[n][c] = x;
                        tile_max = fmaxf(tile_max, x);
                    }
                }
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
                const float m_new = fmaxf(m_run[h], tile_max);
                const float m_use = m_new == NEG_INF ? 0.0f : m_new;  // all -inf so far: no NaN
                const float alpha = expf(m_run[h] - m_use);
                float sum = 0.0f;
                #pragma unroll
                for (int n = 0; n < SN; ++n) {
                    #pragma unroll
                    for (int c = 2 * h; c < 2 * h + 2; ++c) {
                        s[n][c] = expf(s[n][c] - m_use);
                        sum += s[n][c];
                    }
                }
                l_run[h] = l_run[h] * alpha + sum;
                m_run[h] = m_new;
                #pragma unroll
                for (int n = 0; n < DN; ++n) {
                    o[n][2 * h] *= alpha;
                    o[n][2 * h + 1] *= alpha;
                }
            }
            #pragma unroll
            for (int pk = 0; pk < SN / 2; ++pk) {
                uint32_t a[4];
                a[0] = mlxspec_pack2<T>(s[2 * pk][0], s[2 * pk][1]);
                a[1] = mlxspec_pack2<T>(s[2 * pk][2], s[2 * pk][3]);
                a[2] = mlxspec_pack2<T>(s[2 * pk + 1][0], s[2 * pk + 1][1]);
                a[3] = mlxspec_pack2<T>(s[2 * pk + 1][2], s[2 * pk + 1][3]);
                #pragma unroll
                for (int n = 0; n < DN; n += 2) {
                    uint32_t bv[4];
                    mlxspec_ldsm4<true>(bv, v_t + (pk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * ROW + n * 8
                                            + (lane / 16) * 8);
                    mma16816<T>(o[n], a, bv[0], bv[1]);
                    mma16816<T>(o[n + 1], a, bv[2], bv[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this tile before the next load takes its stage
    }

    // The warps of an m-tile merge: key groups 1.. hand their state to group 0 (lane by lane,
    // in the space the tiles used; [slot][element][lane] so that lanes hit distinct banks).
    float* st = reinterpret_cast<float*>(kv_s);
    if (KG > 1) {
        if (busy && kgw > 0) {
            float* mine = st + ((kgw - 1) * MT + mt) * NE * 32 + lane;
            #pragma unroll
            for (int n = 0; n < DN; ++n) {
                #pragma unroll
                for (int c = 0; c < 4; ++c) {
                    mine[(n * 4 + c) * 32] = o[n][c];
                }
            }
            mine[(DN * 4) * 32] = m_run[0];
            mine[(DN * 4 + 1) * 32] = m_run[1];
            mine[(DN * 4 + 2) * 32] = l_run[0];
            mine[(DN * 4 + 3) * 32] = l_run[1];
        }
        __syncthreads();
        if (busy && kgw == 0) {
            #pragma unroll
            for (int w = 1; w < KG; ++w) {
                const float* theirs = st + ((w - 1) * MT + mt) * NE * 32 + lane;
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float m_o = theirs[(DN * 4 + h) * 32];
                    const float m_new = fmaxf(m_run[h], m_o);
                    const float m_use = m_new == NEG_INF ? 0.0f : m_new;
                    const float f_me = expf(m_run[h] - m_use);
                    const float f_o = expf(m_o - m_use);  // a warp without keys: 0
                    l_run[h] = l_run[h] * f_me + theirs[(DN * 4 + 2 + h) * 32] * f_o;
                    m_run[h] = m_new;
                    #pragma unroll
                    for (int n = 0; n < DN; ++n) {
                        #pragma unroll
                        for (int c = 2 * h; c < 2 * h + 2; ++c) {
                            o[n][c] = o[n][c] * f_me + theirs[(n * 4 + c) * 32] * f_o;
                        }
                    }
                }
            }
        }
    }

    if (busy && kgw == 0) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l_sum = l_run[h];
            l_sum += __shfl_xor_sync(0xffffffff, l_sum, 1);
            l_sum += __shfl_xor_sync(0xffffffff, l_sum, 2);
            const int rg = q0 + 16 * mt + grp + 8 * h;
            if (rg < R) {
                const int g = rg / L;
                const int i = rg - g * L;
                const long long slot = (((long long)b * Hq + kvh * G + g) * L + i) * n_chunks + chunk;
                if (tig == 0) {
                    part_m[slot] = m_run[h];
                    part_l[slot] = l_sum;
                }
                #pragma unroll
                for (int n = 0; n < DN; ++n) {
                    *reinterpret_cast<float2*>(part_o + slot * D + n * 8 + 2 * tig)
                        = make_float2(o[n][2 * h], o[n][2 * h + 1]);
                }
            }
        }
    }
""").replace("TILE_KEYS", str(TILE_KEYS))


def shared_bytes(head_dim: int, m_tiles: int) -> int:
    """Dynamic shared memory: the queries and two stages of keys and values, as 16-bit T
    (the warps' merge reuses the stages)."""
    row = head_dim + 8
    return 2 * row * (16 * m_tiles + 2 * 2 * TILE_KEYS)


def m_tiles_for(vectors: int) -> int:
    """m-tiles a block: the fewest that hold VECTORS, at most 4 (more go to further blocks)."""
    return next((t for t in TILES if 16 * t >= vectors), max(TILES))
