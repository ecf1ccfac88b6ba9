"""What the ragged forward's shared nodes save the host: a verify forward of B rows x W tokens
over rows of different lengths (512 + 8 i tokens), with the write positions spread to the keys'
shape once a forward (``ragged_kv._spread``) and the mask viewed once for all layers
(``kernels.attention_mask.kernel_mask``), against the same forward with both made again in each
layer (as before 2026-11-28: a broadcast node a write and a layer). Pairs in turn (ABAB): the
graph's build, its launch (``mx.async_eval``) and the whole waited forward, medians, ms; and the
per-pair ratio of the waited forward.

    python3 benchmarks/diag_ragged_nodes.py [--shape qwen3-8b] [--rows 4] [--width 5] [--reps 12] [--json OUT]
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
from mlxspec.engine import ragged_kv
from mlxspec.engine.batch_step import greedy_tokens
from mlxspec.kernels import attention

SHARED = (ragged_kv._spread, attention.kernel_mask)
# every layer its own: put_along_axis broadcasts the positions itself, the mask viewed anew
APART = (lambda at, shape: at,
         lambda mask, shape: mx.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), shape))


def timed_forward(cache, x: mx.array) -> tuple[float, float, float]:
    """CACHE's forward on X to greedy tokens: (build, launch, build to tokens read), seconds."""
    t0 = time.perf_counter()
    out = greedy_tokens(cache.forward(x)[0])
    t1 = time.perf_counter()
    mx.async_eval(out)
    t2 = time.perf_counter()
    out.tolist()
    return t1 - t0, t2 - t1, time.perf_counter() - t0


def ab_summary(times: dict[str, list[tuple[float, float, float]]], a: str, b: str) -> dict:
    """Medians (ms) of each way's build, launch and forward, and the per-pair ratio A / B of the
    forward: median, IQR and every pair."""
    out = {name: {k: round(statistics.median(v[i] for v in rows) * 1e3, 2)
                  for i, k in enumerate(("build_ms", "launch_ms", "forward_ms"))} for name, rows in times.items()}
    ratios = sorted(x[2] / y[2] for x, y in zip(times[a], times[b]))
    q = statistics.quantiles(ratios, n=4)
    out["forward_ratio"] = {"median": round(statistics.median(ratios), 3), "iqr": [round(q[0], 3), round(q[2], 3)],
                            "pairs": [round(x, 3) for x in ratios]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape)
    cache = ragged(model, args.rows, 500, vocab, 8)
    cache.rollback([0] * args.rows)  # one offset array for all layers, as a step leaves it
    mx.eval([c.state for c in cache.layers])
    times: dict[str, list[tuple[float, float, float]]] = {"shared": [], "apart": []}
    for r in range(args.reps + 1):  # the first pair warms up
        for name, (spread, mask) in (("shared", SHARED), ("apart", APART)):
            ragged_kv._spread, attention.kernel_mask = spread, mask
            x = mx.array([[(5 * i + j + r) % vocab for j in range(args.width)] for i in range(args.rows)], mx.uint32)
            took = timed_forward(cache, x)
            # rows keep different counts, then one offset array for all layers again
            cache.rollback([args.width - i % args.width for i in range(args.rows)])
            cache.rollback([0] * args.rows)
            mx.eval([c.state for c in cache.layers])
            if r:
                times[name].append(took)
    ragged_kv._spread, attention.kernel_mask = SHARED
    out = {"shape": args.shape, "rows": args.rows, "width": args.width, "reps": args.reps,
           **ab_summary(times, "shared", "apart")}
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
