"""What a batch's verify step costs on the device, part by part: waited forwards of B rows x W
tokens over the batch's ragged cache (``batch_cache.RaggedCache``, rows of different lengths,
as ``BatchedDecoder`` runs them) against one row's forward over its own cache, and the ragged
rollback (``RaggedCache.rollback``) after a verify, ms, fastest of REPS. A forward is also
split into the host's graph building (the model call), its launch (``mx.async_eval``: on CUDA
the host encoding every kernel) and the wait for the device after it, each the median of REPS.

    python3 benchmarks/diag_batch_forward.py [--shape qwen3-8b] [--rows 1,2,4] [--widths 1,2,4,5,8]
        [--context 512] [--spread 8] [--reps 5] [--json OUT]

--spread S: row i is prefilled to CONTEXT + S i tokens (0: every row the same length, as requests
of one prompt length start; the ragged cache then needs no mask).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.batch_cache import RaggedCache


def ragged(model, rows: int, context: int, vocab: int, spread: int = 8) -> RaggedCache:
    """ROWS rows prefilled alone to CONTEXT + SPREAD i tokens and joined, as rows join a batch."""
    cache = RaggedCache(model)
    for i in range(rows):
        row = make_prompt_cache(model)
        n = context + spread * i
        mx.eval(model(mx.array([[(7 * t + i) % vocab for t in range(n)]], mx.uint32), cache=row))
        cache.join(row)
    mx.eval([c.state for c in cache.layers])
    return cache


def time_forward(cache: RaggedCache, rows: int, width: int, reps: int, vocab: int, junk) -> dict:
    """A waited forward of ROWS x WIDTH tokens, then its rollback by JUNK(width) positions a row
    (waited too): ms, the fastest of REPS for the forward and the rollback, the median for the
    forward's parts (build, launch, wait)."""
    fwd = back = float("inf")
    parts = {"build": [], "launch": [], "wait": []}
    for r in range(reps + 1):  # the first warms up
        inputs = mx.array([[(11 * r + 5 * i + j) % vocab for j in range(width)] for i in range(rows)], mx.uint32)
        mx.eval(inputs)
        t0 = time.perf_counter()
        logits, _, _ = cache.forward(inputs)
        tb = time.perf_counter()
        mx.async_eval(logits)
        tl = time.perf_counter()
        mx.eval(logits)
        t1 = time.perf_counter()
        cache.rollback(junk(width))
        mx.eval([c.state for c in cache.layers])
        t2 = time.perf_counter()
        if r:
            fwd, back = min(fwd, t1 - t0), min(back, t2 - t1)
            for name, ms in (("build", tb - t0), ("launch", tl - tb), ("wait", t1 - tl)):
                parts[name].append(ms)
    return {"forward_ms": round(fwd * 1e3, 3), "rollback_ms": round(back * 1e3, 3),
            **{f"{name}_ms": round(statistics.median(v) * 1e3, 3) for name, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--widths", default="1,2,4,5,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--spread", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-kernels", action="store_true", help="stock mlx-lm layers (no mlxspec kernel)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape, kernels=not args.no_kernels)
    out = {"shape": args.shape, "context": args.context, "spread": args.spread, "kernels": not args.no_kernels}

    def measure(cache: RaggedCache, rows: int, width: int) -> dict:
        # every row keeps one token (the worst ragged case: all junk but the first) ...
        even = time_forward(cache, rows, width, args.reps, vocab, lambda w: [w - 1] * rows)
        # ... or row i keeps i + 1 (a different amount a row: the gather runs)
        uneven = time_forward(cache, rows, width, args.reps, vocab, lambda w: [max(w - 1 - i, 0) for i in range(rows)])
        trim = even.pop("rollback_ms")
        return {**even, "rollback_trim_ms": trim, "rollback_ragged_ms": uneven["rollback_ms"]}

    sweep(model, args, vocab, args.spread, measure, out)


def sweep(model, args, vocab: int, spread: int, measure, out: dict) -> None:
    """For each of ARGS.rows, a ragged cache of that many rows (prefilled once), then
    ``measure(cache, rows, width)`` for each of ARGS.widths: each cell printed as it comes, all
    of them in OUT["cells"], written to ARGS.json."""
    out["cells"] = []
    for rows in [int(x) for x in args.rows.split(",")]:
        cache = ragged(model, rows, args.context, vocab, spread)
        for width in [int(x) for x in args.widths.split(",")]:
            cell = {"rows": rows, "width": width, **measure(cache, rows, width)}
            out["cells"].append(cell)
            print(json.dumps(cell), flush=True)
        del cache
        mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
