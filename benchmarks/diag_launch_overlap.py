"""Whether the host can launch a forward while the one before it runs on the device: two
forwards of B rows x W tokens over the batch's ragged cache, the second built and launched
(``mx.async_eval``) right after the first is launched, before anything waits. If the second's
launch costs about the first's device time more than the first's launch, launching blocked on
the forward in flight and pipelining a batch's steps (``engine/batch_pipeline.py``) cannot
overlap them. Medians of REPS, ms; MLX's CUDA graph settings (``MLX_MAX_OPS_PER_BUFFER``,
``MLX_USE_CUDA_GRAPHS``) come from the environment and are echoed in the output.

    python3 benchmarks/diag_launch_overlap.py [--shape qwen3-8b] [--rows 1,4] [--widths 1,5]
        [--context 512] [--reps 6] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.diag_batch_forward import sweep
from mlxspec.bench.synthetic import random_model, vocab_size

ENV = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_USE_CUDA_GRAPHS", "MLX_CUDA_GRAPH_CACHE_SIZE")


def time_pair(cache, rows: int, width: int, reps: int, vocab: int) -> dict:
    """Median ms of: the first forward's build and launch, the second's build and launch (the
    first in flight), the wait for both, and a single waited forward's whole time."""
    parts: dict[str, list[float]] = {k: [] for k in ("build1", "launch1", "build2", "launch2", "wait", "single")}
    for r in range(reps + 1):  # the first warms up
        feed = [mx.array([[(11 * r + 5 * i + j + 3 * s) % vocab for j in range(width)] for i in range(rows)],
                         mx.uint32) for s in range(3)]
        mx.eval(feed)
        t0 = time.perf_counter()
        first = cache.forward(feed[0])[0]
        t1 = time.perf_counter()
        mx.async_eval(first)
        t2 = time.perf_counter()
        second = cache.forward(feed[1])[0]
        t3 = time.perf_counter()
        mx.async_eval(second)
        t4 = time.perf_counter()
        mx.eval(first, second)
        t5 = time.perf_counter()
        cache.rollback([2 * width] * rows)
        mx.eval([c.state for c in cache.layers])
        t6 = time.perf_counter()
        mx.eval(cache.forward(feed[2])[0])
        t7 = time.perf_counter()
        cache.rollback([width] * rows)
        mx.eval([c.state for c in cache.layers])
        if r:
            for name, ms in (("build1", t1 - t0), ("launch1", t2 - t1), ("build2", t3 - t2),
                             ("launch2", t4 - t3), ("wait", t5 - t4), ("single", t7 - t6)):
                parts[name].append(ms * 1e3)
    return {f"{k}_ms": round(statistics.median(v), 3) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--widths", default="1,5")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape)
    out = {"shape": args.shape, "context": args.context, "env": {k: os.environ.get(k) for k in ENV}}
    sweep(model, args, vocab, 0, lambda cache, rows, width: time_pair(cache, rows, width, args.reps, vocab), out)


if __name__ == "__main__":
    main()
