"""Whether a batch's decode step is bound by the host or by the device: sleep D ms on the host at
the start of every step of N requests (``bench --real-shapes SHAPE --concurrency N``'s batched
engine, without the stock process) and watch the step period. A device-bound step hides the
sleep (the device still runs the forward launched before it) until D reaches the device's slack;
a host-bound step grows by D from the first millisecond. Period: the median time between the
starts of consecutive steps while all N rows decode; sleeps in turn (0, 3, ... ms), REPS rounds
after a warm-up round.

    python3 benchmarks/diag_host_bound.py [--shape qwen3-8b] [--workload echo] [--rows 4]
        [--sleeps 0,3,6,9,12] [--reps 2] [--prompt-tokens 512] [--compiled on|off] [--json OUT]

--compiled on: the batch's forwards replayed from compiled graphs (engine/compiled_forward.py),
not built op by op (the engine's default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.bench.real_concurrency import BATCHED, ConcurrencyBench
from mlxspec.engine import batch


def periods(bench: ConcurrencyBench, workload: str, rows: int, sleep_ms: float) -> tuple[list[float], dict]:
    """Step periods (ms) of one run with SLEEP_MS slept before each step, and the run's stats."""
    real = batch.BatchedDecoder._decode
    starts: list[tuple[float, int]] = []

    def decode(self):
        if sleep_ms:
            time.sleep(sleep_ms / 1e3)
        starts.append((time.perf_counter(), len(self.rows)))
        return real(self)

    batch.BatchedDecoder._decode = decode
    try:
        run = bench.run(BATCHED, workload, rows)
    finally:
        batch.BatchedDecoder._decode = real
    full = [(b[0] - a[0]) * 1e3 for a, b in zip(starts, starts[1:]) if a[1] == rows and b[1] == rows]
    return full, run.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--workload", default="echo")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--sleeps", default="0,3,6,9,12")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--compiled", choices=("on", "off"), default="off")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    real_init = batch.BatchedDecoder.__init__
    batch.BatchedDecoder.__init__ = lambda self, *a, **k: real_init(self, *a, **k, compiled=args.compiled == "on")
    bench = ConcurrencyBench(args.shape, bits=4, prompt_tokens=args.prompt_tokens, max_tokens=128,
                             workloads=[args.workload], requests=args.rows, stock=False)
    sleeps = [float(s) for s in args.sleeps.split(",")]
    out = {"shape": args.shape, "workload": args.workload, "rows": args.rows, "compiled": args.compiled, "cells": []}
    for rep in range(args.reps + 1):  # the first round warms up
        for d in sleeps:
            full, stats = periods(bench, args.workload, args.rows, d)
            cell = {"round": rep, "sleep_ms": d, "steps": len(full),
                    "period_ms": round(statistics.median(full), 2), "stats": stats}
            print(json.dumps(cell), flush=True)
            if rep:
                out["cells"].append(cell)
    out["median_period_ms"] = {str(d): statistics.median(c["period_ms"] for c in out["cells"] if c["sleep_ms"] == d)
                               for d in sleeps}
    print(json.dumps(out["median_period_ms"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
