"""Where a batch's step goes: host milliseconds a step in each phase of ``BatchedDecoder._decode``
(drafting, reading drafts, building the target forward's graph, building the acceptance,
queueing a plain step, committing, rolling back) and the step in all, for N requests of a real
shape's scripted workload (as ``bench --real-shapes SHAPE --concurrency N``, without the stock
process). "queue plain" includes building its own forward, which "forward (build)" counts
too; "launch (async_eval)" is the host's time encoding the queued kernels; what the other
phases leave of a step is mostly waiting for the device. Phases nest: "queued verify (queue)"
holds a forward's build, "leave" a row's prefix-cache store and the batch's filter.

    python benchmarks/diag_batch_phases.py [--shape qwen3-8b] [--workload echo] [--rows 4]
        [--reps 3] [--max-tokens 128] [--json OUT] [--profile N] [--pipeline on|off|both]
        [--no-drafter] [--compiled on|off|both]

--pipeline both: the repetitions alternate the pipelined steps (engine/batch_pipeline.py) on and
off, in one process (ABAB), and each cell says which it ran. --compiled both: the same for the
batch's forwards replayed from compiled graphs (engine/compiled_forward.py) or built op by op.

--profile N: the last repetition also runs under cProfile, and its N costliest functions (own
time) are printed: where the host's milliseconds go, waiting for the device included (the
reads of results, ``tolist`` / ``item``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.bench.real_concurrency import BATCHED, BATCHED_PLAIN, ConcurrencyBench
from mlxspec.engine import batch, batch_ahead, batch_cache, batch_pipeline, compiled_forward

# phase -> (owner, attribute): each is wrapped with a timer for the run
PHASES = {
    "plan": (batch.Row, "plan"),
    "draft": (batch, "draft_together"),
    "read drafts": (batch.Row, "read"),
    "forward (build)": (batch.BatchedDecoder, "_forward"),
    "greedy accept (build)": (batch, "greedy_accept"),
    "queue plain": (batch.BatchedDecoder, "_queue_plain"),
    "commit": (batch.Row, "commit"),
    "rollback": (batch_cache.RaggedCache, "rollback"),
    "queued verify (guess, build)": (batch_ahead.BatchAhead, "make"),
    "queued verify (queue)": (batch_ahead.BatchAhead, "queue"),
    "leave": (batch.BatchedDecoder, "_leave"),
    "pipelined: guesses": (batch_pipeline.Pipeline, "_guesses"),
    "pipelined: launch (build)": (batch_pipeline.Pipeline, "_launch"),
    "step": (batch.BatchedDecoder, "_decode"),
}


def timed(fn, name: str, spent: dict, calls: dict):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
    return wrapper


class TimedMx:
    """engine/batch.py's ``mx`` with its ``async_eval`` timed ("launch"): on CUDA, encoding a
    forward's kernels is host time spent there; what a step leaves after every phase is then
    the wait for the device's results (``tolist``)."""

    def __init__(self, mx, spent: dict, calls: dict):
        self._mx, self._spent, self._calls = mx, spent, calls

    def __getattr__(self, name):
        return getattr(self._mx, name)

    def async_eval(self, *args):
        t0 = time.perf_counter()
        try:
            return self._mx.async_eval(*args)
        finally:
            self._spent["launch (async_eval)"] += time.perf_counter() - t0
            self._calls["launch (async_eval)"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--workload", default="echo")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--pipeline", choices=("on", "off", "both"), default="on")
    ap.add_argument("--no-drafter", action="store_true", help="every row decodes plainly")
    ap.add_argument("--compiled", choices=("on", "off", "both"), default="on")
    args = ap.parse_args()
    real_init = batch.BatchedDecoder.__init__
    bench = ConcurrencyBench(args.shape, bits=4, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                             workloads=[args.workload], requests=args.rows, stock=False)
    out = {"shape": args.shape, "workload": args.workload, "rows": args.rows, "reps": []}
    ways = {"on": [True], "off": [False], "both": [True, False]}
    modes = [(p, c) for p in ways[args.pipeline] for c in ways[args.compiled]]
    for rep in range(len(modes) * (args.reps + 1)):  # the first of each mode warms up
        pipelined, compiled = modes[rep % len(modes)]
        batch.BatchedDecoder.__init__ = lambda self, *a, _p=pipelined, _c=compiled, **k: real_init(
            self, *a, **k, pipeline=_p, compiled=_c)
        spent, calls = defaultdict(float), defaultdict(int)
        saved = {name: getattr(owner, attr) for name, (owner, attr) in PHASES.items()}
        for name, (owner, attr) in PHASES.items():
            setattr(owner, attr, timed(saved[name], name, spent, calls))
        real_mx = batch.mx
        batch.mx = batch_pipeline.mx = TimedMx(real_mx, spent, calls)
        try:
            profile = cProfile.Profile() if args.profile and rep == len(modes) * (args.reps + 1) - 1 else None
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            run = bench.run(BATCHED_PLAIN if args.no_drafter else BATCHED, args.workload, args.rows)
            if profile is not None:
                profile.disable()
            wall = time.perf_counter() - t0
        finally:
            for name, (owner, attr) in PHASES.items():
                setattr(owner, attr, saved[name])
            batch.mx = batch_pipeline.mx = real_mx
            batch.BatchedDecoder.__init__ = real_init
        steps = max(calls["step"], 1)
        names = [*PHASES, "launch (async_eval)"]
        cell = {"pipeline": pipelined, "compiled": compiled, "wall_s": round(wall, 3), "steps": calls["step"],
                "tokens": sum(len(t) for t in run.tokens),
                "ms_per_step": {n: round(spent[n] / steps * 1e3, 3) for n in names},
                "calls": {n: calls[n] for n in names}, "stats": run.stats,
                "graphs_traced_so_far": compiled_forward.traces()[0],
                "trace_s_so_far": round(compiled_forward.traces()[1], 3)}
        if rep >= len(modes):
            out["reps"].append(cell)
        print(json.dumps(cell), flush=True)
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
