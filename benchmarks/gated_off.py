"""What a drafter the gate switched off costs: paired against `--drafter none` in one process.

    python3 benchmarks/gated_off.py --shape qwen3-8b --reps 16 --json gated-off.json

Builds the shape as `mlxspec bench --real-shapes` does and runs, per repetition, `mlxspec-none`
then each drafter on a workload where its drafts are never right (novel text: prompt lookup finds
nothing, the MTP head and the draft model are steered off the script), rotating the order each
repetition. Each drafter's ratio is its tok/s over the `none` run of the same repetition; the
median and IQR of those ratios are printed and written. Both engines are mlxspec's (kernels on
in both): this measures the drafter's own cost, not mlxspec against stock mlx-lm.
"""

import argparse
import json
import statistics

from mlxspec.bench.real_shapes import Cell, ShapeBench


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return [round(q[0], 4), round(statistics.median(xs), 4), round(q[2], 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--workload", default="novel")
    ap.add_argument("--engines", default="mlxspec-pld,mlxspec-mtp,mlxspec-draft")
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    engines = a.engines.split(",")
    bench = ShapeBench(a.shape, bits=4, prompt_tokens=512, max_tokens=a.max_tokens, workloads=[a.workload],
                       reps=a.reps, on_step=print, stock=False)
    cells = [Cell(a.workload, "mlxspec-none")] + [Cell(a.workload, e) for e in engines]
    for c in cells:  # warm-up: kernels built, caches sized
        bench.run(c)
    tps = {c.engine: [] for c in cells}
    ratios = {e: [] for e in engines}
    probes = {e: [] for e in engines}
    for rep in range(a.reps):
        order = cells if rep % 2 == 0 else cells[::-1]  # ABBA: neither side always runs first
        runs = {c.engine: bench.run(c) for c in order}
        for e, run in runs.items():
            tps[e].append(run.tps)
        for e in engines:
            ratios[e].append(runs[e].tps / runs["mlxspec-none"].tps)
            probes[e].append((runs[e].stats["probes"], runs[e].stats["verify_steps"]))
        print(f"rep {rep + 1}: " + "  ".join(f"{e} {runs[e].tps:.1f}" for e in tps))
    out = {"shape": a.shape, "workload": a.workload, "max_tokens": a.max_tokens, "reps": a.reps,
           "order": "ABBA, alternating", "baseline": "mlxspec-none (same process)",
           "tps": {e: [round(x, 2) for x in v] for e, v in tps.items()}, "cells": []}
    for e in engines:
        q1, med, q3 = quartiles(ratios[e])
        out["cells"].append({"engine": e, "ratio_to_none": med, "ratio_iqr": [q1, q3],
                             "probes_and_verifies": probes[e][0]})
        print(f"{e:16} / none: median {med:.3f} (IQR {q1:.3f}-{q3:.3f}), probes/verifies {probes[e][0]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
