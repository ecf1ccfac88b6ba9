"""Where a real-shape cell's time goes, step by step (for the GPU machine).

    python3 benchmarks/diag_steps.py --shape qwen3.6-35b-a3b --workload novel --engine mlxspec-mtp

Builds the shape as `mlxspec bench --real-shapes` does, runs the cell twice (warm-up, then
measured) and prints the wall time of every plain and speculative step, and of the MTP head's
pair commits and the target's rollbacks, each waited for (mx.synchronize) so it is attributed
to its phase. Waiting costs the overlap the engine normally has: compare shapes of the
distribution, not totals, with the bench.
"""

import argparse
import collections
import json
import statistics
import time

import mlx.core as mx

from mlxspec.bench.real_shapes import BASELINE, Cell, ShapeBench
from mlxspec.engine import cache, speculate
from mlxspec.engine.drafters import mtp

times = collections.defaultdict(list)


def timed(cls, name, label, sync=True):
    orig = getattr(cls, name)

    def wrapper(*args, **kwargs):
        if sync:
            mx.synchronize()
        t0 = time.perf_counter()
        out = orig(*args, **kwargs)
        if sync:
            mx.synchronize()
        times[label].append(1e3 * (time.perf_counter() - t0))
        return out

    setattr(cls, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smoke-moe")
    ap.add_argument("--workload", default="novel")
    ap.add_argument("--engine", default="mlxspec-mtp")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    bench = ShapeBench(a.shape, bits=4, prompt_tokens=512, max_tokens=a.max_tokens,
                       workloads=[a.workload], reps=3, on_step=print)
    cell = Cell(a.workload, a.engine)
    base = Cell(a.workload, BASELINE)  # stock mlx-lm, in its own process
    for c in (base, cell, base, cell):  # warm-up, then measured
        times.clear()
        run = bench.run(c)
        print(c.engine, f"{run.tps:.1f} tok/s")
    untimed = bench.run(cell)
    timed(speculate._Run, "_plain_step", "plain step")
    timed(speculate._Run, "_speculative_step", "speculative step")
    timed(mtp.MTPDrafter, "_commit", "mtp commit")
    timed(cache.ModelState, "rollback_to", "rollback")
    times.clear()
    run = bench.run(cell)
    out = {"shape": a.shape, "workload": a.workload, "engine": a.engine, "tps_untimed": untimed.tps,
           "stats": run.stats, "phases": {}}
    for label, ms in times.items():
        out["phases"][label] = {"n": len(ms), "total_ms": round(sum(ms), 1),
                                "median_ms": round(statistics.median(ms), 2), "max_ms": round(max(ms), 1),
                                "all_ms": [round(x, 2) for x in ms]}
        print(f"{label:18} n={len(ms):4d} total {sum(ms):8.1f} ms  median {statistics.median(ms):7.2f}"
              f"  max {max(ms):7.1f}")
    print("gate events", run.stats["gate_events"], "depths", run.stats["depth_histogram"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
