"""Host cost of one graph node, by kind: what building (the Python call, nothing runs) and
evaluating (MLX encodes the node into its CUDA graph and launches it) cost a call, on shapes so
small that the GPU's own work is negligible. For the GPU machine.

MLX decoding on CUDA is host-bound: a forward of the 8B shape builds in ~4.6 ms and evaluates
in ~7.8 ms while the GPU's share is a fraction of that, so a verify costs what its nodes cost
the host, not what its kernels cost the GPU. This says which nodes are dear.

    python3 benchmarks/diag_host_cost.py [--calls 400] [--rounds 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx

from mlxspec.kernels import attention, qmm, qmm_tc

K, N = 4096, 256  # a matrix small enough that its kernel's run time is negligible


def cases() -> dict:
    """name -> a function making one node (or the few a call makes) from fresh inputs."""
    w, s, b = mx.quantize(mx.random.normal((N, K)).astype(mx.bfloat16), group_size=64, bits=4)
    x = {r: mx.random.normal((r, K)).astype(mx.bfloat16) for r in (1, 2, 4)}
    h = mx.random.normal((1, 1, K)).astype(mx.bfloat16)
    nw = mx.ones((K,), dtype=mx.bfloat16)
    q = {L: mx.random.normal((1, 32, L, 128)).astype(mx.bfloat16) for L in (1, 2)}
    kv = mx.random.normal((1, 8, 600, 128)).astype(mx.bfloat16)
    buf = mx.zeros((1, 8, 1024, 128), dtype=mx.bfloat16)
    mx.eval(w, s, b, x, h, nw, q, kv, buf)

    def qmm_mlx(r):
        return lambda: mx.quantized_matmul(x[r], w, s, b, transpose=True, group_size=64, bits=4)

    def qmm_ours(r):
        return lambda: qmm_tc.quantized_matmul(x[r], w, s, b, group_size=64)

    def custom(header: str, contiguous: bool):
        kernel = mx.fast.cuda_kernel(name=f"mlxspec_diag_copy_{len(header)}_{int(contiguous)}", input_names=["x"],
                                     output_names=["y"], header=header, ensure_row_contiguous=contiguous,
                                     source="const int i = blockIdx.x * blockDim.x + threadIdx.x;"
                                            " if (i < x_shape[2]) { y[i] = x[i]; }")
        return lambda: kernel(inputs=[h], template=[("T", h.dtype)], grid=(K, 1, 1), threadgroup=(256, 1, 1),
                              output_shapes=[h.shape], output_dtypes=[h.dtype])[0]

    padding = "// " + "x" * 76 + "\n"
    return {
        "add": lambda: h + 1,
        "custom kernel, tiny source": custom("", True),
        "custom kernel, 12 KB header": custom(padding * 150, True),
        "custom kernel, no contiguity check": custom("", False),
        "reshape+transpose (views)": lambda: h.reshape(1, 1, 32, 128).transpose(0, 2, 1, 3),
        "rms_norm (fast)": lambda: mx.fast.rms_norm(h, nw, 1e-6),
        "rope (fast)": lambda: mx.fast.rope(q[1], 128, traditional=False, base=1e6, scale=1.0, offset=600),
        "slice_update (cache write)": lambda: mx.slice_update(buf, kv[:, :, :1], mx.array(600), axes=(2,)),
        "qmm mlx 1 row": qmm_mlx(1),
        "qmm mlx 4 rows": qmm_mlx(4),
        "qmm tensor-core 1 row": qmm_ours(1),
        "qmm tensor-core 2 rows": qmm_ours(2),
        "qmm tensor-core 4 rows": qmm_ours(4),
        "qmm small-M 2 rows": lambda: qmm.quantized_matmul(x[2], w, s, b, group_size=64, bits=4),
        "sdpa mlx 1 row": lambda: mx.fast.scaled_dot_product_attention(q[1], kv, kv, scale=0.088),
        "verify attention 2 rows (ours)": lambda: attention.verify_attention(q[2], kv, kv, 0.088, "causal"),
    }


def time_case(make, calls: int, rounds: int) -> dict:
    build, run = [], []
    for r in range(rounds + 1):  # a warm-up round (compiles)
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [make() for _ in range(calls)]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t2 = time.perf_counter()
        if r:
            build.append((t1 - t0) / calls * 1e6)
            run.append((t2 - t1) / calls * 1e6)
    return {"build_us": round(statistics.median(build), 2), "eval_us": round(statistics.median(run), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = {"device": mx.device_info().get("device_name"), "calls": args.calls, "rounds": args.rounds, "cases": {}}
    for name, make in cases().items():
        res["cases"][name] = cell = time_case(make, args.calls, args.rounds)
        print(f"{name:34s} build {cell['build_us']:7.2f} us  eval {cell['eval_us']:7.2f} us", flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
