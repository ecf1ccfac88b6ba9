"""A few calls of each verify op for Nsight Compute to time on the GPU itself (no host cost):

    ncu --metrics gpu__time_duration.sum python3 benchmarks/diag_ncu_probe.py

MLX's 1-row attention and quantized matmul against the verify attention kernel and the small-M
matmul at 4 rows, in the Qwen3-8B shapes (32/8 heads of 128, 600 keys; the 12288x4096
gate/up projection, 4-bit). The first call of each kernel includes its compilation.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mlxspec.kernels import attention, qmm  # noqa: E402


def main() -> None:
    k = mx.random.normal((1, 8, 600, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, 600, 128)).astype(mx.bfloat16)
    q1 = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    q4 = mx.random.normal((1, 32, 4, 128)).astype(mx.bfloat16)
    w = mx.random.normal((12288, 4096)).astype(mx.bfloat16) * 0.05
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x1 = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    x4 = mx.random.normal((4, 4096)).astype(mx.bfloat16)
    mx.eval(k, v, q1, q4, wq, s, b, x1, x4)
    for _ in range(3):
        mx.eval(mx.fast.scaled_dot_product_attention(q1, k, v, scale=0.088, mask=None))
        mx.eval(attention.verify_attention(q4, k, v, 0.088, "causal"))
        mx.eval(mx.quantized_matmul(x1, wq, s, b, transpose=True, group_size=64, bits=4))
        mx.eval(mx.quantized_matmul(x4, wq, s, b, transpose=True, group_size=64, bits=4))
        mx.eval(qmm.quantized_matmul(x4, wq, s, b, group_size=64, bits=4))


if __name__ == "__main__":
    main()
