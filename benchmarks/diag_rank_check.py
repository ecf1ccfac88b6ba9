"""What the ranks' per-step check (engine/ranks.checked) costs plain decoding on a sharded target:
mlxspec's plain decoding (`mlxspec-none`) with the check, as `run` and `serve` do it, and with it
taken out, each paired against stock mlx-lm's plain decoding of the same shard, in rotating order.

    mlx.launch --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 ... -- \
        python3 benchmarks/diag_rank_check.py --shape qwen3-8b --reps 8 --json rank-check.json

Started without mlx.launch it runs on one device (no check to take out: both mlxspec runs are
the same). Diagnostic only: without the check a rank that diverged would go unseen; here every
run's tokens are compared with the first stock run's instead.
"""

import argparse
import json
import statistics

from mlxspec.bench.real_plan import BASELINE, Cell
from mlxspec.bench.real_sharded import ShardedShapeBench
from mlxspec.engine import ranks
from mlxspec.models.sharding import world

CELLS = {"stock": Cell("echo", BASELINE), "checked": Cell("echo", "mlxspec-none"),
         "unchecked": Cell("echo", "mlxspec-none")}


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return [round(q[0], 4), round(statistics.median(xs), 4), round(q[2], 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    group = world()
    first = group is None or group.rank() == 0
    bench = ShardedShapeBench(a.shape, group, bits=4, prompt_tokens=512, max_tokens=a.max_tokens,
                              workloads=["echo"], reps=a.reps, on_step=print if first else None)
    real = ranks.checked

    def run(name):
        ranks.checked = real if name != "unchecked" else (lambda steps, group: steps)
        try:
            return bench.run(CELLS[name])
        finally:
            ranks.checked = real

    for name in CELLS:  # warm-up
        run(name)
    tps = {name: [] for name in CELLS}
    reference, identical = None, True
    for rep in range(a.reps):
        names = list(CELLS)
        names = names[rep % 3:] + names[: rep % 3]
        for name in names:
            r = run(name)
            tps[name].append(r.tps)
            reference = reference or r.tokens
            identical &= r.tokens == reference
    out = {"shape": a.shape, "ranks": group.size() if group is not None else 1, "reps": a.reps,
           "max_tokens": a.max_tokens, "identical": identical, "kernels": bench.kernels,
           "tps": {n: quartiles(v) for n, v in tps.items()},
           "over_stock": {n: quartiles([x / s for x, s in zip(tps[n], tps["stock"])])
                          for n in ("checked", "unchecked")},
           "unchecked_over_checked": quartiles([u / c for u, c in zip(tps["unchecked"], tps["checked"])]),
           "reps_tps": tps}
    if first:
        print(json.dumps({k: v for k, v in out.items() if k != "reps_tps"}, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
