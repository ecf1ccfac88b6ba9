"""What routing a forward's small matrices and one-query batch attention to our kernels saves:
N echo requests of a real shape (scripted, 4-bit random weights), batched and served one after
another, with the routing of 2026-12-07 ("new": a matrix under ``qmm.MIN_WEIGHT_BYTES``, such
as a k/v projection, takes the tensor-core kernel from ``qmm.MLX_GEMM_ROWS`` rows, and a
batch's one query a row under an array mask takes the verify attention kernel) against the
routing before ("old": both MLX's), ABAB in one process. Each arm traces its own compiled
graphs (a scope each), in a first untimed round. Aggregate tok/s a run, the per-pair ratio
first arm / second (median and IQR); every run's tokens are checked against its script. A
serial run of several requests also gives its batching bound (``Run.batching_bound``).

--arms A,B picks the two routings: ``new`` and ``old`` as above, and ``tc2`` (new, but a small
matrix takes the tensor-core kernel from 2 rows: a narrow verify's k/v projections, which MLX's
qmv reads once per row); ``dequant`` (new, and a prompt's prefill chunk dequantizes each matrix
and multiplies in bf16: ``qmm.DEQUANT_ROWS``) and ``mlx-prefill`` (new, prefill on MLX's quantized
matmul). --workload and --engines (``batched``, ``serial``) pick the runs:
``--rows 1 --workload mtp-like --engines serial`` is one request's mtp-like decoding.

    python3 benchmarks/diag_small_matrix_routing.py [--shape qwen3-8b] [--rows 4] [--reps 8]
        [--arms new,old] [--workload echo] [--engines batched,serial] [--json OUT]
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
NEW_DEQUANT_ROWS = qmm.DEQUANT_ROWS


def old_eligible(queries, keys, values, cache, mask, sinks) -> bool:
    """The attention routing before: one query row never took the kernel (ONE_ROW_FROM_KEYS is
    empty by default)."""
    return queries.shape[2] >= attention.MIN_ROWS and NEW_ELIGIBLE(queries, keys, values, cache, mask, sinks)


# arm -> (qmm.MLX_GEMM_ROWS, attention.eligible, qmm.DEQUANT_ROWS)
ARMS = {"new": (NEW_GEMM_ROWS, NEW_ELIGIBLE, NEW_DEQUANT_ROWS), "old": (1 << 30, old_eligible, NEW_DEQUANT_ROWS),
        "tc2": (2, NEW_ELIGIBLE, NEW_DEQUANT_ROWS), "dequant": (NEW_GEMM_ROWS, NEW_ELIGIBLE, qmm.TC_SPLIT_MAX + 1),
        "mlx-prefill": (NEW_GEMM_ROWS, NEW_ELIGIBLE, None)}
ENGINES = {"batched": BATCHED, "serial": SERIAL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", help="a real shape (mlxspec bench --help lists them)")
    ap.add_argument("--rows", type=int, default=4, help="requests served at once (the batch's rows)")
    ap.add_argument("--reps", type=int, default=8, help="interleaved repetitions (ABAB) of each arm")
    ap.add_argument("--arms", default="new,old", help=f"two of {', '.join(ARMS)}")
    ap.add_argument("--workload", default="echo", help="echo or mtp-like, as in bench --real-shapes")
    ap.add_argument("--engines", default="batched,serial", help=f"of {', '.join(ENGINES)}")
    ap.add_argument("--json", type=Path, help="write the runs and paired ratios here")
    args = ap.parse_args()
    n, work = args.rows, args.workload
    first, second = args.arms.split(",")
    bench = ConcurrencyBench(args.shape, bits=4, prompt_tokens=512, max_tokens=128, workloads=[work],
                             requests=n, stock=False, reps=3)

    def arm(name: str) -> None:
        qmm.MLX_GEMM_ROWS, attention.eligible, qmm.DEQUANT_ROWS = ARMS[name]
        bench.follow(work)
        CompiledForward.of(bench.model).scope = (work, name)  # graphs traced under this arm's routing

    out = {"shape": args.shape, "rows": n, "reps": args.reps, "workload": work, "arms": [first, second], "cells": {}}
    scripts = bench.scripts[work][:n]
    for engine in (ENGINES[e] for e in args.engines.split(",")):
        tps: dict[str, list[float]] = {first: [], second: []}
        bounds: dict[str, list[float]] = {first: [], second: []}
        for r in range(args.reps + 1):  # round 0 warms both arms up
            for name in (first, second):
                arm(name)
                run = bench.run(engine, work, n)
                assert all(t == s.target[len(s.prompt):len(s.prompt) + len(t)] for t, s in zip(run.tokens, scripts))
                if r:
                    tps[name].append(run.aggregate_tps)
                    if run.serial and n > 1:
                        bounds[name].append(run.batching_bound)
        ratios = [a / b for a, b in zip(tps[first], tps[second])]
        out["cells"][engine] = {f"{first}_tps": tps[first], f"{second}_tps": tps[second],
                                f"{first}_median": statistics.median(tps[first]),
                                f"{second}_median": statistics.median(tps[second]),
                                f"{first}_over_{second}": statistics.median(ratios), "quartiles": quartiles(ratios)}
        for name, values in bounds.items():  # a serial run's most a batch could gain (Run.batching_bound)
            if values:
                out["cells"][engine][f"{name}_batching_bound"] = quartiles(values)
        print(json.dumps({engine: out["cells"][engine]}), flush=True)
    arm("new")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
