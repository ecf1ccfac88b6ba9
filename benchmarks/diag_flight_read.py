"""Whether reading a launched forward waits for the forward launched after it (MLX's CUDA
``async_eval`` events): forward A of B rows x W tokens over the batch's ragged cache, then B,
each launched with ``mx.async_eval`` before anything waits; then A's tokens read, then B's. If
reading A took about B's device time, a pipelined batch step (``engine/batch_pipeline.py``)
would wait for its successor too. Also: A alone (launch, then the read), and A read after a 30 ms
sleep. Medians of REPS, ms.

    python3 benchmarks/diag_flight_read.py [--shape qwen3-8b] [--rows 4] [--width 5] [--reps 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.diag_batch_forward import ragged
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.batch_step import greedy_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape)
    cache = ragged(model, args.rows, args.context, vocab, 0)
    rows, width = args.rows, args.width

    def launch(seed: int) -> mx.array:
        x = mx.array([[(7 * seed + 5 * i + j) % vocab for j in range(width)] for i in range(rows)], mx.uint32)
        tokens = greedy_tokens(cache.forward(x)[0])
        mx.async_eval(tokens)
        return tokens

    def back(forwards: int) -> None:
        cache.rollback([width * forwards] * rows)
        mx.eval([c.state for c in cache.layers])

    names = ("alone_launch", "alone_read", "pair_launch_a", "pair_launch_b", "pair_read_a", "pair_read_b",
             "read_after_sleep")
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.reps + 1):  # the first warms up
        t0 = time.perf_counter()
        a = launch(r)
        t1 = time.perf_counter()
        a.tolist()
        t2 = time.perf_counter()
        back(1)
        t3 = time.perf_counter()
        a = launch(r)
        t4 = time.perf_counter()
        b = launch(r + 1)
        t5 = time.perf_counter()
        a.tolist()
        t6 = time.perf_counter()
        b.tolist()
        t7 = time.perf_counter()
        back(2)
        a = launch(r)
        time.sleep(0.03)
        t8 = time.perf_counter()
        a.tolist()
        t9 = time.perf_counter()
        back(1)
        if r:
            for n, s in zip(names, (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t9 - t8)):
                got[n].append(s * 1e3)
    out = {"shape": args.shape, "rows": rows, "width": width, "context": args.context, "reps": args.reps,
           "median_ms": {n: round(statistics.median(v), 2) for n, v in got.items()},
           "ms": {n: [round(x, 2) for x in v] for n, v in got.items()}}
    print(json.dumps(out["median_ms"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
