"""Quantized matmul on tensor cores for a verify of 2..32 rows (a batch's too), each 4-bit weight read once.

A batch of B rows verifying k drafts each is a forward of B x (k + 1) rows (4 rows at depth 4:
20). :mod:`.qmm`'s small-M kernel accumulates on the CUDA cores and stops at 8 rows; past that
MLX's matmul ran, and a forward of the 8B shape cost 2.1x a 1-row forward at 12-16 rows and 2.7x
at 20-32 (one H200; 1.5-1.7x with this kernel, docs/benchmarks.md). Here each warp computes
16 x MT output columns for every row with ``mma.sync.m16n8k16`` (bf16 or fp16 in, fp32
accumulated), the rows in tiles of 8. It beat the small-M kernel at 2..8 rows too, so quantized
layers send it every 2..32-row verify its layout allows (:mod:`.qmm`).

A row's outputs do not depend on the other rows (each output is its own dot product, and the
K split depends on the matrix alone), so a token's logits are the same in a verify of any
width.

Terms: x is [M, K] (rows, input features), w is [N, K / 8] (4-bit, 8 values a uint32, lowest
bits first, MLX's affine packing: value = scale * q + bias per group of GS along K), y is [M, N].

The k order inside an mma. A dot product does not care in which order its k terms are summed,
so the 16 k slots of one mma need not be 16 consecutive k: each lane (group g = lane / 4,
t = lane % 4) streams 32 consecutive k of its columns (one 16-byte load) and feeds them to its
own slots. Lane t's slots {2t, 2t + 1} and {2t + 8, 2t + 9} take the pairs (v_p, v_p+4) of one
packed word, which one mask-and-or turns into two half floats at once; x is loaded as the same
8 consecutive values and paired the same way with a byte permute. A and B see the same k at
the same slot, which is all the mma needs.

The warps of a block split K (KW warps, 128 k each in turn) over the same columns and sum
their partial tiles in shared memory at the end: a verify's N columns / (16 x MT) alone would
leave most of the GPU's multiprocessors idle.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .mma import MMA16816
from .switch import compact, int_array, quantized_matmul_kernel, run_quantized_matmul

BITS = 4
GROUP_SIZES = (32, 64, 128)
K_STEP = 128  # k a warp covers per loop pass: 4 lanes x 32 values
MAX_ROWS = 32  # rows a block computes (4 tiles of 8); more rows go in even pieces, a piece a grid row
MAX_CALL_ROWS = 8 * MAX_ROWS
DTYPES = (mx.bfloat16, mx.float16)

_HEADER = """
template <typename T> struct Half2;
template <> struct Half2<__nv_bfloat16> {
    using type = __nv_bfloat162;
    static constexpr uint32_t MAGIC = 0x43004300u;  // 128.0 in both halves: 128 + q is exact
    __device__ static type broadcast(__nv_bfloat16 v) { return __bfloat162bfloat162(v); }
    __device__ static type magic() { return __floats2bfloat162_rn(128.0f, 128.0f); }
};
template <> struct Half2<__half> {
    using type = __half2;
    static constexpr uint32_t MAGIC = 0x64006400u;  // 1024.0 in both halves
    __device__ static type broadcast(__half v) { return __half2half2(v); }
    __device__ static type magic() { return __floats2half2_rn(1024.0f, 1024.0f); }
};

// Values p and p + 4 of a packed word, dequantized: low half from bits 4p.., high from 16 + 4p..
template <typename T>
__device__ inline uint32_t dequant_pair(uint32_t word, int p, typename Half2<T>::type scale,
                                        typename Half2<T>::type bias) {
    using H2 = typename Half2<T>::type;
    uint32_t raw = ((word >> (4 * p)) & 0x000F000Fu) | Half2<T>::MAGIC;
    H2 q = __hsub2(*reinterpret_cast<H2*>(&raw), Half2<T>::magic());  // exact: q < 16
    H2 v = __hfma2(q, scale, bias);  // one rounding, as scale * q + bias in float, then rounded
    return *reinterpret_cast<uint32_t*>(&v);
}

// x values p and p + 4 of 8 consecutive halves held in 4 words (X0 = (h0, h1), ...).
__device__ inline uint32_t x_pair(const uint32_t* xw, int p) {
    const uint32_t lo = xw[p / 2], hi = xw[2 + p / 2];
    return __byte_perm(lo, hi, (p % 2) == 0 ? 0x5410 : 0x7632);
}

""" + MMA16816

_SOURCE = """
    // x: [M, K]; w: [N, K / 8] uint32; scales, biases: [N, K / GS]; y: [M, N]
    // Template: InT (bf16 or fp16), MT (16-column tiles a warp), NT (8-row tiles), KW (warps a block).
    // Rows in pieces of P (at most 32): grid y is the piece, rows row0 .. row0 + MP - 1.
    using H2 = typename Half2<InT>::type;
    const int K = dims[1];
    const int N = dims[2];
    const int GS = dims[3];
    const int row0 = blockIdx.y * dims[4];
    const int MP = min(dims[4], dims[0] - row0);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;   // mma group: A row (output column) g and g + 8, B column (x row) g
    const int t = lane % 4;   // lane in group: its k slots
    const int col0 = blockIdx.x * (16 * MT);
    const int words = K / 8;
    const int groups = K / GS;

    int wcol[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        wcol[mt][0] = min(col0 + 16 * mt + g, N - 1);      // past N: a duplicate, never written
        wcol[mt][1] = min(col0 + 16 * mt + g + 8, N - 1);
    }
    int xrow[NT];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        xrow[nt] = row0 + min(8 * nt + g, MP - 1);         // past the piece: a duplicate, never written
    }
    float acc[MT][NT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[mt][nt][r] = 0.0f;

    for (int k0 = warp * 128; k0 < K; k0 += KW * 128) {
        const int kt = k0 + 32 * t;   // this lane's 32 consecutive k
        uint4 wq[MT][2];
        H2 sc[MT][2], bi[MT][2];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const size_t col = wcol[mt][h];
                wq[mt][h] = __ldg(reinterpret_cast<const uint4*>(w + col * words + kt / 8));
                sc[mt][h] = Half2<InT>::broadcast(scales[col * groups + kt / GS]);
                bi[mt][h] = Half2<InT>::broadcast(biases[col * groups + kt / GS]);
            }
        }
        #pragma unroll
        for (int wi = 0; wi < 4; ++wi) {   // packed word wi: k = kt + 8 wi .. + 7
            uint32_t xw[NT][4];
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)xrow[nt] * K + kt + 8 * wi);
                xw[nt][0] = v.x; xw[nt][1] = v.y; xw[nt][2] = v.z; xw[nt][3] = v.w;
            }
            uint32_t wp[MT][2][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t word = wi == 0 ? wq[mt][h].x : wi == 1 ? wq[mt][h].y
                                        : wi == 2 ? wq[mt][h].z : wq[mt][h].w;
                    #pragma unroll
                    for (int p = 0; p < 4; ++p) wp[mt][h][p] = dequant_pair<InT>(word, p, sc[mt][h], bi[mt][h]);
                }
            }
            #pragma unroll
            for (int step = 0; step < 2; ++step) {   // pairs 2 step (slots 2t, 2t+1) and 2 step + 1 (2t+8, 2t+9)
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const uint32_t b0 = x_pair(xw[nt], 2 * step);
                    const uint32_t b1 = x_pair(xw[nt], 2 * step + 1);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const uint32_t a[4] = {wp[mt][0][2 * step], wp[mt][1][2 * step],
                                               wp[mt][0][2 * step + 1], wp[mt][1][2 * step + 1]};
                        mma16816<InT>(acc[mt][nt], a, b0, b1);
                    }
                }
            }
        }
    }

    // The KW warps' partial tiles summed in shared memory; entry e = ((mt * NT + nt) * 4 + r) * 32 + lane.
    constexpr int ENTRIES = MT * NT * 4 * 32;
    __shared__ float partial[KW * ENTRIES];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int r = 0; r < 4; ++r)
                partial[warp * ENTRIES + ((mt * NT + nt) * 4 + r) * 32 + lane] = acc[mt][nt][r];
    __syncthreads();
    for (int e = threadIdx.x; e < ENTRIES; e += KW * 32) {
        float total = 0.0f;
        #pragma unroll
        for (int kw = 0; kw < KW; ++kw) total += partial[kw * ENTRIES + e];
        const int el = e % 32, r = (e / 32) % 4, nt = (e / 128) % NT, mt = e / (128 * NT);
        // C fragment: c0, c1 at (row g, cols 2t, 2t+1), c2, c3 at (row g + 8, same cols);
        // rows are output columns here, cols are x rows.
        const int col = col0 + 16 * mt + el / 4 + (r >= 2 ? 8 : 0);
        const int row = 8 * nt + 2 * (el % 4) + (r % 2);
        if (row < MP && col < N) {
            y[(size_t)(row0 + row) * N + col] = static_cast<InT>(total);
        }
    }
"""
# what MLX gets: the code without its comments (every call's node carries a copy)
_HEADER, _SOURCE = compact(_HEADER), compact(_SOURCE)


@functools.cache
def _kernel():
    return quantized_matmul_kernel("mlxspec_qmm_tensor_cores", _HEADER, _SOURCE)


def eligible(x_dtype, w: mx.array, scales: mx.array, biases, group_size: int, bits: int, mode: str) -> bool:
    """Layouts the kernel takes: affine 4-bit, group 32/64/128, bf16 or fp16 activations in the
    scales' type, K a multiple of 128."""
    return (
        mode == "affine" and biases is not None and bits == BITS and group_size in GROUP_SIZES
        and x_dtype == scales.dtype and x_dtype in DTYPES
        and w.ndim == 2 and (w.shape[1] * 8) % K_STEP == 0
    )


def split_k(n_cols: int, k: int, col_tiles: int) -> int:
    """Warps a block splits K over: enough warps in all to fill the GPU (about 8 a
    multiprocessor on 132), at least 2 passes of 128 k each."""
    blocks = -(-n_cols // (16 * col_tiles))
    kw = 1
    while kw < 8 and blocks * kw < 1024 and k // K_STEP >= 4 * kw:
        kw *= 2
    return kw


def pieces(rows: int) -> tuple[int, int]:
    """(pieces, rows a piece) of a call of ROWS rows: as few pieces of at most MAX_ROWS as can
    be, as even as can be (40 rows: two of 20)."""
    count = -(-rows // MAX_ROWS)
    return count, -(-rows // count)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *,
                     group_size: int, bits: int = BITS, col_tiles: int = 2, warps: int | None = None) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`` for x of at most
    :data:`MAX_CALL_ROWS` rows (all leading axes together), on tensor cores. Past MAX_ROWS the
    rows go in :func:`pieces`, each reading the weights again, all in one call: a call's host
    time is what a wide verify pays most on CUDA (a call a piece made an 8 x 5 forward of the 8B
    shape cost the host 23.7 ms against 10.4 for 4 x 5, diag-launch-overlap-h100-8b.json)."""
    if bits != BITS:
        raise ValueError(f"the tensor-core kernel takes {BITS}-bit weights, got {bits}")
    return run_quantized_matmul(_kernel, x, w, scales, biases, max_rows=MAX_CALL_ROWS,
                                name="tensor-core quantized matmul",
                                plan=lambda rows, K, N: _launch(rows, K, N, group_size, x.dtype, col_tiles, warps))


@functools.lru_cache(maxsize=1024)
def _launch(rows: int, K: int, N: int, group_size: int, dtype, col_tiles: int,
            warps: int | None) -> tuple[dict, mx.array]:
    """A call's template, grid (column blocks x pieces) and block, and its dims array: made once
    a shape (host time a call is what a verify pays for on CUDA). A row's sums do not depend on
    its piece: the K split is the matrix's alone."""
    kw = warps or split_k(N, K, col_tiles)
    count, piece = pieces(rows)
    launch = {"template": [("InT", dtype), ("MT", col_tiles), ("NT", -(-piece // 8)), ("KW", kw)],
              "grid": (32 * kw * -(-N // (16 * col_tiles)), count, 1), "threadgroup": (32 * kw, 1, 1)}
    return launch, int_array(rows, K, N, group_size, piece)
