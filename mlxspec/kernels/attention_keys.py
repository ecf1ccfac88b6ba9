"""Pass 1 of the verify attention kernel with its warps splitting the keys (see
``attention_source.py``): the variant for few query vectors a KV head.

queries [B, Hq, L, D], keys / values [B, Hkv, S, D], any strides (elements); part_o
[B * Hq * L, chunks, D], part_m / part_l [B * Hq * L, chunks] (float32). Grid: x = key chunk,
y = tile of QPW query vectors, z = batch * Hkv; NW warps a block. Lane j of a warp reads key j
of the warp's tile into registers and scores it against every query vector (staged once in
shared memory, scaled); the warp keeps an online softmax (running max, sum and unscaled output,
float32) and each lane adds its D / 32 head dims of the tile's value rows, read coalesced,
weighted through the warp's buffer of the tile's weights. The block merges its warps' states
and writes one partial per chunk.
"""

from .switch import compact

PARTIAL_BY_KEYS = compact("""
    constexpr int TK = 32;
    constexpr int EPL = D / 32;                   // head dims a lane accumulates
    constexpr int THREADS = NW * 32;
    constexpr int VE = 16 / sizeof(T);            // elements in 16 bytes
    constexpr int PIECES = D / VE;                // 16-byte pieces of a key row
    constexpr int KG = PIECES < 4 ? PIECES : 4;   // pieces of its key a lane loads at once
    constexpr int VB = 32 / EPL;                  // value rows a lane holds at once
    constexpr int VBYTES = EPL * sizeof(T) < 16 ? EPL * sizeof(T) : 16;  // a lane's value alignment
    const float NEG_INF = __int_as_float(0xff800000);
    extern __shared__ float4 mlxspec_attn_smem[];

    KV_HEAD_SHAPES  // Hq, L, Hkv, S, G, R (query vectors a KV head), n_chunks, chunk (snippets:
                    // attention_source.py)
    const int q0 = blockIdx.y * QPW;
    const int nq = min(QPW, R - q0);
    BLOCK_THREAD  // b, kvh, tid, warp, lane
    KEY_CHUNK  // chunk_len, k_begin, k_end
    const float sc = scale[0];
    // While the keys are read: [QPW][D] scaled queries, then each warp's [QPW][TK] weights.
    // After: each warp's [QPW][D] outputs, then its [QPW] maxima and sums.
    float* q_s = reinterpret_cast<float*>(mlxspec_attn_smem);
    float* p_s = q_s + QPW * D + warp * QPW * TK;
    float* o_s = reinterpret_cast<float*>(mlxspec_attn_smem);
    float* m_s = o_s + NW * QPW * D;
    float* l_s = m_s + NW * QPW;

    for (int e = tid; e < QPW * D; e += THREADS) {
        const int r = e / D;
        const int d = e - r * D;
        float x = 0.0f;
        if (r < nq) {
            const int g = (q0 + r) / L;
            const int i = q0 + r - g * L;
            x = static_cast<float>(queries[b * queries_strides[0] + (kvh * G + g) * queries_strides[1]
                                           + i * queries_strides[2] + d * queries_strides[3]]) * sc;
        }
        q_s[e] = x;
    }
    __syncthreads();

    float m_run[QPW];
    float l_run[QPW];  // this lane's share of the sum (its keys); added across lanes at the end
    float acc[QPW][EPL];
    mlxspec_attn_init<QPW, EPL>(m_run, l_run, acc);
    const T* k_src = keys + b * keys_strides[0] + kvh * keys_strides[1];
    const T* v_src = values + b * values_strides[0] + kvh * values_strides[1];
    const long long ks = keys_strides[2];
    const long long vs = values_strides[2];
    const bool k_vec = keys_strides[3] == 1 && ks % VE == 0
        && reinterpret_cast<unsigned long long>(k_src) % 16 == 0;  // the same for the whole block
    const bool v_vec = values_strides[3] == 1 && vs % (VBYTES / sizeof(T)) == 0
        && reinterpret_cast<unsigned long long>(v_src) % VBYTES == 0;

    for (int k0 = k_begin + warp * TK; k0 < k_end; k0 += NW * TK) {
        const int n_keys = min(TK, k_end - k0);
        float s[QPW];
        #pragma unroll
        for (int t = 0; t < QPW; ++t) {
            s[t] = 0.0f;
        }
        if (lane < n_keys) {
            const T* k_row = k_src + (k0 + lane) * ks;
            if (k_vec) {
                #pragma unroll
                for (int c0 = 0; c0 < PIECES; c0 += KG) {
                    float kf[KG * VE];
                    #pragma unroll
                    for (int c = 0; c < KG; ++c) {
                        mlxspec_attn_load16<T>(k_row + (c0 + c) * VE, kf + c * VE);
                    }
                    #pragma unroll
                    for (int t = 0; t < QPW; ++t) {
                        if (t < nq) {
                            const float4* qq = reinterpret_cast<const float4*>(q_s + t * D + c0 * VE);
                            #pragma unroll
                            for (int u = 0; u < KG * VE / 4; ++u) {
                                const float4 q4 = qq[u];
                                s[t] += kf[4 * u] * q4.x + kf[4 * u + 1] * q4.y + kf[4 * u + 2] * q4.z
                                    + kf[4 * u + 3] * q4.w;
                            }
                        }
                    }
                }
            } else {
                for (int d = 0; d < D; ++d) {
                    const float kd = static_cast<float>(k_row[(long long)d * keys_strides[3]]);
                    #pragma unroll
                    for (int t = 0; t < QPW; ++t) {
                        if (t < nq) {
                            s[t] += kd * q_s[t * D + d];
                        }
                    }
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
                p_s[t * TK + lane] = mlxspec_attn_online<EPL>(x, m_run[t], l_run[t], acc[t]);
            }
        }
        __syncwarp();

        for (int j0 = 0; j0 < n_keys; j0 += VB) {
            float v[VB][EPL];
            #pragma unroll
            for (int u = 0; u < VB; ++u) {
                const int j = j0 + u;
                if (j < n_keys) {
                    const T* v_row = v_src + (k0 + j) * vs;
                    if (v_vec) {
                        mlxspec_attn_vec<T, EPL * sizeof(T)>::load(v_row + lane * EPL, v[u]);
                    } else {
                        #pragma unroll
                        for (int e = 0; e < EPL; ++e) {
                            v[u][e] = static_cast<float>(v_row[(long long)(lane * EPL + e) * values_strides[3]]);
                        }
                    }
                } else {
                    #pragma unroll
                    for (int e = 0; e < EPL; ++e) {
                        v[u][e] = 0.0f;  // weight 0: no stale value meets it as NaN
                    }
                }
            }
            #pragma unroll
            for (int t = 0; t < QPW; ++t) {
                if (t < nq) {
                    #pragma unroll
                    for (int u = 0; u < VB; u += 4) {
                        const float4 p4 = *reinterpret_cast<const float4*>(p_s + t * TK + j0 + u);
                        #pragma unroll
                        for (int e = 0; e < EPL; ++e) {
                            acc[t][e] += p4.x * v[u][e] + p4.y * v[u + 1][e] + p4.z * v[u + 2][e]
                                + p4.w * v[u + 3][e];
                        }
                    }
                }
            }
        }
        __syncwarp();  // every lane is done with the tile's weights
    }

    __syncthreads();  // every warp is done with the queries and weights: the space holds outputs
    #pragma unroll
    for (int t = 0; t < QPW; ++t) {
        if (t < nq) {
            float l_sum = l_run[t];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                l_sum += __shfl_xor_sync(0xffffffff, l_sum, off);
            }
            if (lane == 0) {
                m_s[warp * QPW + t] = m_run[t];
                l_s[warp * QPW + t] = l_sum;
            }
            #pragma unroll
            for (int e = 0; e < EPL; ++e) {
                o_s[(warp * QPW + t) * D + lane * EPL + e] = acc[t][e];
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < nq * D; e += THREADS) {
        const int t = e / D;
        const int d = e - t * D;
        float m = NEG_INF;
        #pragma unroll
        for (int w = 0; w < NW; ++w) {
            m = fmaxf(m, m_s[w * QPW + t]);
        }
        const float m_use = m == NEG_INF ? 0.0f : m;
        float o = 0.0f;
        float l = 0.0f;
        #pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float f = expf(m_s[w * QPW + t] - m_use);  // a warp without keys: 0
            o += f * o_s[(w * QPW + t) * D + d];
            l += f * l_s[w * QPW + t];
        }
        const int g = (q0 + t) / L;
        const int i = q0 + t - g * L;
        const long long slot = (((long long)b * Hq + kvh * G + g) * L + i) * n_chunks + chunk;
        part_o[slot * D + d] = o;
        if (d == 0) {
            part_m[slot] = m;
            part_l[slot] = l;
        }
    }
""")
