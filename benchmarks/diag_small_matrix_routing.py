"""What routing a forward's small matrices and one-query batch attention to our kernels saves:
N echo requests of a real shape (scripted, 4-bit random weights), batched and served one after
another, with the routing of 2026-12-07 ("new": a matrix under ``qmm.MIN_WEIGHT_BYTES``, such
as a k/v projection, takes the tensor-core kernel from ``qmm.MLX_GEMM_ROWS`` rows, and a
batch's one query a row under an array mask takes the verify attention kernel) against the
routing before ("old": both MLX's), ABAB in one process. Each arm traces its own compiled
graphs (a scope each), in a first untimed round. Aggregate tok/s a run, the per-pair ratio
new / old (median and IQR); every run's tokens are checked against its script.

    python3 benchmarks/diag_small_matrix_routing.py [--shape qwen3-8b] [--rows 4] [--reps 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.bench.paired import quartiles
from mlxspec.bench.real_concurrency import BATCHED, SERIAL, ConcurrencyBench
from mlxspec.engine.compiled_forward import CompiledForward
from mlxspec.kernels import attention, qmm

NEW_ELIGIBLE = attention.eligible
NEW_GEMM_ROWS = qmm.MLX_GEMM_ROWS


def old_eligible(queries, keys, values, cache, mask, sinks) -> bool:
    """The attention routing before: one query row never took the kernel (ONE_ROW_FROM_KEYS is
    empty by default)."""
    return queries.shape[2] >= attention.MIN_ROWS and NEW_ELIGIBLE(queries, keys, values, cache, mask, sinks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = args.rows
    bench = ConcurrencyBench(args.shape, bits=4, prompt_tokens=512, max_tokens=128, workloads=["echo"],
                             requests=n, stock=False, reps=3)

    def arm(new: bool) -> None:
        qmm.MLX_GEMM_ROWS = NEW_GEMM_ROWS if new else 1 << 30
        attention.eligible = NEW_ELIGIBLE if new else old_eligible
        bench.follow("echo")
        CompiledForward.of(bench.model).scope = ("echo", new)  # graphs traced under this arm's routing

    out = {"shape": args.shape, "rows": n, "reps": args.reps, "cells": {}}
    scripts = bench.scripts["echo"][:n]
    for engine in (BATCHED, SERIAL):
        tps: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.reps + 1):  # round 0 warms both arms up
            for new in (True, False):
                arm(new)
                run = bench.run(engine, "echo", n)
                assert all(t == s.target[len(s.prompt):len(s.prompt) + len(t)] for t, s in zip(run.tokens, scripts))
                if r:
                    tps[new].append(run.aggregate_tps)
        ratios = [a / b for a, b in zip(tps[True], tps[False])]
        out["cells"][engine] = {"new_tps": tps[True], "old_tps": tps[False],
                                "new_median": statistics.median(tps[True]), "old_median": statistics.median(tps[False]),
                                "new_over_old": statistics.median(ratios), "quartiles": quartiles(ratios)}
        print(json.dumps({engine: out["cells"][engine]}), flush=True)
    arm(True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
