"""What a batch's verify step costs on the device, part by part: waited forwards of B rows x W
tokens over the batch's ragged cache (``batch_cache.RaggedCache``, rows of different lengths,
as ``BatchedDecoder`` runs them) against one row's forward over its own cache, and the ragged
rollback (``RaggedCache.rollback``: trim + ``roll_rows``) after a verify, ms, fastest of REPS.

    python3 benchmarks/diag_batch_forward.py [--shape qwen3-8b] [--rows 1,2,4] [--widths 1,2,4,5,8]
        [--context 512] [--reps 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.batch_cache import RaggedCache


def ragged(model, rows: int, context: int, vocab: int) -> RaggedCache:
    """ROWS rows prefilled alone to CONTEXT + 8 i tokens and joined, as rows join a batch."""
    cache = RaggedCache(model)
    for i in range(rows):
        row = make_prompt_cache(model)
        n = context + 8 * i
        mx.eval(model(mx.array([[(7 * t + i) % vocab for t in range(n)]], mx.uint32), cache=row))
        cache.join(row)
    mx.eval([c.state for c in cache.layers])
    return cache


def time_forward(cache: RaggedCache, rows: int, width: int, reps: int, vocab: int, junk) -> tuple[float, float]:
    """(forward ms, rollback ms): a waited forward of ROWS x WIDTH tokens, then its rollback
    by JUNK(width) positions a row (waited too), fastest of REPS each."""
    fwd = back = float("inf")
    for r in range(reps + 1):  # the first warms up
        inputs = mx.array([[(11 * r + 5 * i + j) % vocab for j in range(width)] for i in range(rows)], mx.uint32)
        t0 = time.perf_counter()
        logits, _, _ = cache.forward(inputs)
        mx.eval(logits)
        t1 = time.perf_counter()
        cache.rollback(junk(width))
        mx.eval([c.state for c in cache.layers])
        t2 = time.perf_counter()
        if r:
            fwd, back = min(fwd, t1 - t0), min(back, t2 - t1)
    return fwd * 1e3, back * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--widths", default="1,2,4,5,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-kernels", action="store_true", help="stock mlx-lm layers (no mlxspec kernel)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape, kernels=not args.no_kernels)
    out = {"shape": args.shape, "context": args.context, "kernels": not args.no_kernels, "cells": []}
    for rows in [int(x) for x in args.rows.split(",")]:
        cache = ragged(model, rows, args.context, vocab)
        for width in [int(x) for x in args.widths.split(",")]:
            # every row keeps one token (the worst ragged case: all junk but the first) ...
            all_junk = lambda w: [w - 1] * rows  # noqa: E731
            # ... or row i keeps i + 1 (a different amount a row: the gather runs)
            uneven = lambda w: [max(w - 1 - i, 0) for i in range(rows)]  # noqa: E731
            fwd, trim = time_forward(cache, rows, width, args.reps, vocab, all_junk)
            _, roll = time_forward(cache, rows, width, args.reps, vocab, uneven)
            cell = {"rows": rows, "width": width, "forward_ms": round(fwd, 3), "rollback_trim_ms": round(trim, 3),
                    "rollback_ragged_ms": round(roll, 3)}
            out["cells"].append(cell)
            print(json.dumps(cell), flush=True)
        del cache
        mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
