"""Small-batch quantized matmul for MLX's CUDA backend: 2..8 rows, each weight read once, and
the routing of a quantized layer's verify rows to it or to the tensor-core kernel (:mod:`.qmm_tc`).

MLX's CUDA quantized matmul for 2..7 rows (the qmv path) reads the weights once per row, so a
verify of 4 tokens costs about 4 decode steps in its linear layers; at 8 rows it switches to a
tensor-core path. Here one warp computes one output column for all M rows: each lane streams
16 bytes of packed weights per step, dequantizes them (affine: scale * q + bias, MLX's packing
of 32/bits values per uint32, lowest bits first) and accumulates them into M row sums.

The tensor-core kernel (2..32 rows, 4-bit weights, bf16/fp16 activations) beat this one on
the 8B shape's matrices at every row count, so this one takes what that one does not: float32
activations and 8-bit weights, at 2..8 rows, for matrices of at least MIN_WEIGHT_BYTES (as
that one). Timed alone, MLX's matmul sometimes wins (mostly at 8 rows, where it switches to
tensor cores), but whole forwards of the 8B and 27B shapes were faster with this kernel at
every row count
(``benchmarks/diag_verify_strategies.py``): alone, a call's time is mostly launch and host cost,
which a forward's hundreds of calls do not add up the same way. Small matrices (an MoE's
experts and its k/v projections) stay on MLX's matmul below 8 rows: there the kernel's host
cost per call is more than reading the matrix once per row. From 8 rows MLX's matmul is a GEMM
whose tiles leave such a matrix most of the GPU idle, and the tensor-core kernel takes them.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear, sum_gradients

from ..compat import swap_class
from . import qmm_tc
from .switch import active, compact, int_array, quantized_matmul_kernel, run_quantized_matmul


def _max_rows(text: str | None) -> int:
    """MLXSPEC_QMM_MAX_ROWS: 8 unless set to a number from 2 to 16 (accumulators are compiled
    for 1, 2, 4, 8 or 16 rows)."""
    return int(text) if text and text.isdigit() and 2 <= int(text) <= 16 else 8


# 8: whole forwards were measured faster with the kernel up to there. A batch's verify of several
# rows is wider (4 rows of 5 tokens: 20); MLXSPEC_QMM_MAX_ROWS=16 sends 9-16 rows here too (an
# experiment, docs/benchmarks.md: not the default until measured on every shape).
MAX_ROWS = _max_rows(os.environ.get("MLXSPEC_QMM_MAX_ROWS"))
# Decode (1 row) keeps MLX's kernel, so plain decoding is stock MLX's, bit for bit. Both our
# kernels are faster than MLX's alone on the GPU at 1 row, but decoding on CUDA is host-bound and
# a custom kernel's call costs the host more: the tensor-core one made pipelined decoding 0.72x
# as fast (docs/benchmarks.md).
MIN_ROWS = 2
# A small matrix stays on MLX's matmul: reading it once per row costs less than the host time of
# a custom kernel's call...
MIN_WEIGHT_BYTES = 4 << 20
# ...below this many rows, where MLX's is its qmv (M * B < 8 in MLX's QuantizedMatmul). From 8
# rows MLX's is a GEMM of 128-column tiles, which leaves a k/v projection's 1,024 columns 8
# blocks: on an H100 its 72 calls (8B shape, 16 or 28 rows) took 4.07 ms of an 11.3 ms forward
# (ncu), against 0.92 ms as qmv at 4 rows. The tensor-core kernel takes them there, as it takes
# the large matrices.
MLX_GEMM_ROWS = 8
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

_HEADER = """
template <typename T, int N> __device__ inline void load_floats(const T* p, float* out);

template <> __device__ inline void load_floats<float, 8>(const float* p, float* out) {
    float4 a = *reinterpret_cast<const float4*>(p);
    float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
template <> __device__ inline void load_floats<float, 4>(const float* p, float* out) {
    float4 a = *reinterpret_cast<const float4*>(p);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
}
template <> __device__ inline void load_floats<__nv_bfloat16, 8>(const __nv_bfloat16* p, float* out) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
template <> __device__ inline void load_floats<__nv_bfloat16, 4>(const __nv_bfloat16* p, float* out) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int i = 0; i < 2; ++i) { float2 f = __bfloat1622float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
template <> __device__ inline void load_floats<__half, 8>(const __half* p, float* out) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    for (int i = 0; i < 4; ++i) { float2 f = __half22float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
template <> __device__ inline void load_floats<__half, 4>(const __half* p, float* out) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    for (int i = 0; i < 2; ++i) { float2 f = __half22float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
"""

_SOURCE = """
    // x: [M, K]; w: [N, K * Bits / 32] uint32; scales, biases: [N, K / GS]; y: [M, N]
    // A warp computes Cols adjacent output columns for all M rows: each x chunk it loads
    // serves Cols columns, and the Cols weight loads of a step are in flight together.
    constexpr int VPW = 32 / Bits;       // values per packed uint32
    constexpr int VPL = 4 * VPW;         // values per lane per step (one 16-byte load)
    constexpr uint32_t MASK = (1u << Bits) - 1u;
    const int M = dims[0];
    const int K = dims[1];
    const int N = dims[2];
    const int GS = dims[3];
    const int col0 = ((blockIdx.x * blockDim.x + threadIdx.x) / 32) * Cols;
    const int lane = threadIdx.x % 32;
    if (col0 >= N) {
        return;  // whole warps only: col0 is the same on all lanes of a warp
    }
    float acc[MaxM][Cols];
    #pragma unroll
    for (int m = 0; m < MaxM; ++m) {
        #pragma unroll
        for (int c = 0; c < Cols; ++c) {
            acc[m][c] = 0.0f;
        }
    }
    for (int k0 = lane * VPL; k0 < K; k0 += 32 * VPL) {
        uint4 packed[Cols];
        float scale[Cols], bias[Cols];
        #pragma unroll
        for (int c = 0; c < Cols; ++c) {
            const int col = min(col0 + c, N - 1);  // past N: a duplicate, never written
            packed[c] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)col * (K / VPW) + k0 / VPW));
            scale[c] = static_cast<float>(scales[(size_t)col * (K / GS) + k0 / GS]);
            bias[c] = static_cast<float>(biases[(size_t)col * (K / GS) + k0 / GS]);
        }
        #pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
            float wv[Cols][VPW];
            #pragma unroll
            for (int c = 0; c < Cols; ++c) {
                const uint32_t word = wi == 0 ? packed[c].x : wi == 1 ? packed[c].y
                                    : wi == 2 ? packed[c].z : packed[c].w;
                #pragma unroll
                for (int j = 0; j < VPW; ++j) {
                    wv[c][j] = scale[c] * static_cast<float>((word >> (Bits * j)) & MASK) + bias[c];
                }
            }
            const int kk = k0 + wi * VPW;
            #pragma unroll
            for (int m = 0; m < MaxM; ++m) {
                if (m < M) {
                    float xv[VPW];
                    load_floats<InT, VPW>(x + (size_t)m * K + kk, xv);
                    #pragma unroll
                    for (int c = 0; c < Cols; ++c) {
                        #pragma unroll
                        for (int j = 0; j < VPW; ++j) {
                            acc[m][c] += xv[j] * wv[c][j];
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MaxM; ++m) {
        if (m < M) {
            #pragma unroll
            for (int c = 0; c < Cols; ++c) {
                float total = acc[m][c];
                #pragma unroll
                for (int off = 16; off > 0; off >>= 1) {
                    total += __shfl_xor_sync(0xffffffff, total, off);
                }
                if (lane == 0 && col0 + c < N) {
                    y[(size_t)m * N + col0 + c] = static_cast<InT>(total);
                }
            }
        }
    }
"""
# what MLX gets: the code without its comments (every call's node carries a copy)
_HEADER, _SOURCE = compact(_HEADER), compact(_SOURCE)

COLS = 4  # output columns per warp


def _bucket(rows: int) -> int:
    """Accumulator rows compiled in: 1, 2, 4, 8 or 16 (registers grow with them; occupancy falls)."""
    return 1 << (rows - 1).bit_length()


WARPS_PER_BLOCK = 8


@functools.cache
def _kernel():
    return quantized_matmul_kernel("mlxspec_qmm_small_m", _HEADER, _SOURCE)


def eligible(x_dtype, w: mx.array, scales: mx.array, biases, group_size: int, bits: int, mode: str) -> bool:
    """Layouts the kernel takes: affine 4/8-bit, group 32/64/128, activations in the scales'
    float type."""
    return (
        mode == "affine" and biases is not None and bits in BITS and group_size in GROUP_SIZES
        and x_dtype == scales.dtype and x_dtype in (mx.float32, mx.float16, mx.bfloat16)
        and w.ndim == 2 and (w.shape[1] * 32 // bits) % group_size == 0
    )


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *,
                     group_size: int, bits: int) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`` for x of at most
    :data:`MAX_ROWS` rows (all leading axes together)."""
    return run_quantized_matmul(_kernel, x, w, scales, biases, max_rows=MAX_ROWS, name="small-M quantized matmul",
                                plan=lambda rows, K, N: _launch(rows, K, N, group_size, bits, x.dtype))


@functools.lru_cache(maxsize=1024)
def _launch(rows: int, K: int, N: int, group_size: int, bits: int, dtype) -> tuple[dict, mx.array]:
    """A call's template, grid and block, and its dims array: made once a shape (host time a
    call is what a verify pays for on CUDA)."""
    launch = {"template": [("Bits", bits), ("MaxM", _bucket(rows)), ("Cols", COLS), ("InT", dtype)],
              "grid": (32 * -(-N // COLS), 1, 1), "threadgroup": (32 * WARPS_PER_BLOCK, 1, 1)}
    return launch, int_array(rows, K, N, group_size)


# Rows the tensor-core kernel (:mod:`.qmm_tc`) takes where a layer's layout allows (4-bit, bf16
# or fp16): on the 8B shape's matrices it beat this module's kernel at 2..8 rows and MLX's at
# 2..32 (docs/benchmarks.md). range(0) leaves every row count to the paths before it.
TC_ROWS = range(MIN_ROWS, qmm_tc.MAX_ROWS + 1)
# Rows past it, up to this many, go to the same kernel in even pieces of at most its 32 rows
# (qmm_tc.pieces, one call): a batch's verify of 8 rows of 5 tokens is 40 rows, and MLX's matmul
# there made a waited 8 x 5 forward of the 8B shape cost 38.4 ms against 13.8 for 4 x 5 on an
# H200 (diag-batch-forward-h200-8b-split-uniform.json). Each piece reads the weights again:
# measured faster than MLX's matmul at 40 and 72 rows (8 rows of 5 and of 9 tokens); past 72
# (a prompt's prefill chunk, say) MLX's was not measured against it, so it keeps those.
TC_SPLIT_MAX = 72
# From this many rows (a prompt's prefill chunk) a layer dequantizes its weights and multiplies in
# the activations' dtype, where MLX's quantized matmul is its GEMM; None: MLX's matmul. Off: an
# experiment for benchmarks/diag_prefill.py, not yet timed against MLX's.
DEQUANT_ROWS: int | None = None


def _kernel_for(module, x: mx.array):
    """The kernel X's rows take on MODULE: the tensor-core one, this module's, the dense matmul
    of the dequantized weights (from DEQUANT_ROWS), or None (MLX's matmul). Decided once a call,
    the row count first: decoding is host-bound on CUDA, so its one row must cost next to nothing
    more than MLX's own layer (docs/benchmarks.md)."""
    rows = x.size // x.shape[-1]
    if DEQUANT_ROWS is not None and rows >= DEQUANT_ROWS and x.dtype == module.kernel_dtype and active():
        return dequantized_matmul
    wide = rows in TC_ROWS or (bool(TC_ROWS) and qmm_tc.MAX_ROWS < rows <= TC_SPLIT_MAX)
    small = MIN_ROWS <= rows <= MAX_ROWS
    if not (wide or small) or not active():
        return None
    tensor_cores = wide and module.tc_layout and x.dtype == module.kernel_dtype
    if module.weight_bytes < MIN_WEIGHT_BYTES:  # a small matrix: the tensor-core kernel, or MLX's
        return qmm_tc.quantized_matmul if tensor_cores and rows >= MLX_GEMM_ROWS else None
    if tensor_cores:
        return qmm_tc.quantized_matmul
    return quantized_matmul if small else None


def dequantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                       bits: int) -> mx.array:
    """X @ W.T with W dequantized first (to the scales' dtype): one pass over the packed weights,
    then the backend's dense GEMM."""
    return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T


def _matmul(module, x: mx.array, kernel) -> mx.array:
    return kernel(x, module["weight"], module["scales"], module["biases"],
                  group_size=module.group_size, bits=module.bits)


class KernelRoute:
    """What :func:`install` sets on a swapped layer, read on every call; a layer swapped without
    it (``compat.swap_class`` alone) keeps these defaults and always runs MLX's matmul."""

    weight_bytes = 0
    kernel_dtype = None
    tc_layout = False


class SmallMQuantizedLinear(KernelRoute, nn.QuantizedLinear):
    """``nn.QuantizedLinear`` that sends 2..32-row inputs to a kernel where one was faster."""

    def __call__(self, x):
        kernel = _kernel_for(self, x)
        if kernel is None:
            return super().__call__(x)
        y = _matmul(self, x, kernel)
        return y + self["bias"] if "bias" in self else y


class SmallMQuantizedEmbedding(KernelRoute, nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose tied-output ``as_linear`` does the same."""

    def as_linear(self, x):
        kernel = _kernel_for(self, x)
        return super().as_linear(x) if kernel is None else _matmul(self, x, kernel)


class SmallMQuantizedAllToShardedLinear(KernelRoute, QuantizedAllToShardedLinear):
    """A tensor-parallel target's column-split layer (mlx's: this rank's slice of the outputs, no
    collective in the forward pass) with the kernel: a verify's matmul is local to the rank."""

    def __call__(self, x):
        kernel = _kernel_for(self, x)
        if kernel is None:
            return super().__call__(x)
        y = _matmul(self, sum_gradients(self.group)(x), kernel)  # the identity forward, as mlx's layer
        return y + self["bias"] if "bias" in self else y


class SmallMQuantizedShardedToAllLinear(KernelRoute, QuantizedShardedToAllLinear):
    """A tensor-parallel target's row-split layer (mlx's: a partial matmul, then the all-sum over
    the ranks) with the kernel for the partial matmul; the all-sum stays mlx's, in its place."""

    def __call__(self, x):
        kernel = _kernel_for(self, x)
        if kernel is None:
            return super().__call__(x)
        y = mx.distributed.all_sum(_matmul(self, x, kernel), group=self.group)
        return y + self["bias"] if "bias" in self else y


# exact classes: a sharded layer is not a QuantizedLinear, and gets its own kernel class
SWAPS = {nn.QuantizedLinear: SmallMQuantizedLinear, nn.QuantizedEmbedding: SmallMQuantizedEmbedding,
         QuantizedAllToShardedLinear: SmallMQuantizedAllToShardedLinear,
         QuantizedShardedToAllLinear: SmallMQuantizedShardedToAllLinear}


def install(model: nn.Module) -> int:
    """Swap the model's eligible quantized layers for the small-M classes. Returns how many
    layers it swapped."""
    swapped = 0
    for _, module in model.named_modules():
        cls = SWAPS.get(type(module))
        if cls is None:
            continue
        if not eligible(module["scales"].dtype, module["weight"], module["scales"], module.get("biases"),
                        module.group_size, module.bits, getattr(module, "mode", "affine")):
            continue
        swap_class(module, cls)
        # plain attributes, read on every call without an array's bindings
        module.weight_bytes = module["weight"].nbytes
        module.kernel_dtype = module["scales"].dtype
        module.tc_layout = qmm_tc.eligible(module["scales"].dtype, module["weight"], module["scales"],
                                           module.get("biases"), module.group_size, module.bits,
                                           getattr(module, "mode", "affine"))
        swapped += 1
    return swapped
