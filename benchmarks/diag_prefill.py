"""A prompt's prefill on a real shape: MLX's quantized matmul against dequantizing the weights
first and multiplying in bf16 (``qmm.dequantized_matmul``), alone and in whole prefills.

1. Matmuls alone: each distinct (out, in) matrix of the shape at ``--rows`` rows, microseconds a
   call (48 calls cycling over 6 copies of the matrix, median of 5 rounds), and the largest
   difference from MLX's output relative to its largest value.
2. Whole prefills: the model over a ``--prompt``-token prompt but its last token into a fresh
   cache, the cache evaluated (the engines' prefill), then the last token's logits; arms ``mlx``
   (every kernel of ours as by default, prefill rows on MLX's matmul) and ``dequant``
   (``qmm.DEQUANT_ROWS``: from 73 rows, past the tensor-core kernel's), ABAB, ``--reps`` pairs after a
   warm-up pair; milliseconds a prefill, median and quartiles, the per-pair ratio, and the
   largest logit difference between the arms.

    python3 benchmarks/diag_prefill.py [--shape qwen3-8b] [--rows 80,128,512,2048] [--prompt 512,2048]
        [--reps 8] [--json OUT]
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
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.diag_wide_verify import matrices, matrix_copies, microseconds_a_call, relative_error
from mlxspec.bench.paired import quartiles
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.kernels import qmm

HEAD_ROWS = 65536  # a matrix with this many outputs or more is a vocabulary's
ARMS = {"mlx": None, "dequant": qmm.TC_SPLIT_MAX + 1}


def not_the_head(m: nn.Module) -> bool:
    """The output head's matrix aside: a prefill chunk's cache, all it needs, does not read it."""
    return m["weight"].shape[0] < HEAD_ROWS


def time_matmuls(layer, rows: int) -> dict:
    K = layer["weight"].shape[1] * 32 // layer.bits
    x = mx.random.normal((rows, K)).astype(layer["scales"].dtype)
    mx.eval(x)
    copies = matrix_copies(layer)
    gs, bits = layer.group_size, layer.bits
    fns = {"mlx": lambda w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits),
           "dequant": lambda w, s, b: qmm.dequantized_matmul(x, w, s, b, group_size=gs, bits=bits)}
    err = relative_error(fns["dequant"](*copies[0]), fns["mlx"](*copies[0]))
    us = microseconds_a_call(fns, copies, 5)
    mlx_us, deq_us = us["mlx"], us["dequant"]
    tflops = 2 * rows * K * layer["weight"].shape[0] / 1e12
    return {"mlx_us": round(mlx_us, 1), "dequant_us": round(deq_us, 1), "mlx_over_dequant": round(mlx_us / deq_us, 3),
            "mlx_tflops": round(tflops / (mlx_us * 1e-6), 1), "dequant_tflops": round(tflops / (deq_us * 1e-6), 1),
            "max_rel_err": round(err, 5)}


def prefill(model, prompt: mx.array) -> tuple[float, mx.array]:
    """Milliseconds to fill a fresh cache with all but the prompt's last token (as the engines
    prefill: the cache evaluated, not the logits), and the last token's logits after it."""
    cache = make_prompt_cache(model)
    mx.synchronize()
    t0 = time.perf_counter()
    model(prompt[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    ms = (time.perf_counter() - t0) * 1e3
    logits = model(prompt[:, -1:], cache=cache)[:, -1].astype(mx.float32)
    mx.eval(logits)
    return ms, logits


def time_prefills(model, vocab: int, length: int, reps: int) -> dict:
    prompt = mx.random.randint(0, vocab, (1, length))
    ms = {a: [] for a in ARMS}
    last = {}
    for r in range(reps + 1):  # pair 0 warms up
        for a, rows in ARMS.items():
            qmm.DEQUANT_ROWS = rows
            t, last[a] = prefill(model, prompt)
            if r:
                ms[a].append(t)
    qmm.DEQUANT_ROWS = None
    ratios = [m / d for m, d in zip(ms["mlx"], ms["dequant"])]
    diff = mx.max(mx.abs(last["mlx"] - last["dequant"])).item()
    return {"prompt": length, "reps": reps, "mlx_ms": statistics.median(ms["mlx"]), "mlx_iqr": quartiles(ms["mlx"]),
            "dequant_ms": statistics.median(ms["dequant"]), "dequant_iqr": quartiles(ms["dequant"]),
            "mlx_over_dequant": statistics.median(ratios), "ratio_iqr": quartiles(ratios),
            "max_logit_diff": round(diff, 4), "same_argmax": bool(mx.all(mx.argmax(last["mlx"], -1)
                                                                         == mx.argmax(last["dequant"], -1)).item())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", help="a real shape (mlxspec bench --help lists them)")
    ap.add_argument("--rows", default="80,128,512,2048", help="rows a matrix is timed at, comma-separated")
    ap.add_argument("--prompt", default="512,2048", help="prompt lengths whose whole prefill is timed ABAB")
    ap.add_argument("--reps", type=int, default=8, help="interleaved repetitions of each whole prefill")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    model = random_model(args.shape, bits=4)
    res = {"shape": args.shape, "device": mx.device_info().get("device_name"), "matmuls": {}, "prefills": []}
    for key, layer in matrices(model, keep=not_the_head).items():
        for rows in map(int, args.rows.split(",")):
            res["matmuls"][f"{key} @ {rows}"] = cell = time_matmuls(layer, rows)
            print("matmul", key, rows, json.dumps(cell), flush=True)
    for length in map(int, args.prompt.split(",")):
        cell = time_prefills(model, vocab_size(args.shape), length, args.reps)
        res["prefills"].append(cell)
        print("prefill", json.dumps(cell), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
