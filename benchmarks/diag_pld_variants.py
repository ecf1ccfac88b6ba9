"""Prompt lookup on the echo script with and without the gate's early decision, interleaved in
one process (for the GPU machine): is more tokens a step also more tokens a second?

    python3 benchmarks/diag_pld_variants.py --shape qwen3-8b --rounds 12 --max-tokens 128,512

Variants, each the ``mlxspec-pld`` cell of ``mlxspec bench --real-shapes`` on one model:
- ``shipped``: the gate, while off, decides on a shadow proposal as soon as it can
  (``SpeculationGate.decided_early``);
- ``before``: it settles a shadow proposal only once the whole proposal has passed.
Each round runs every variant once, in a rotated order, then stock mlx-lm (its own process).
Per round: each variant's tok/s over ``before``'s in the same round (paired), and over stock.
(Commit 0964f8b's version of this script also ran a substitution lookup, since reverted.)
"""

import argparse
import json
import statistics

from mlxspec.bench.real_shapes import BASELINE, Cell, ShapeBench
from mlxspec.engine import gates

VARIANTS = ("shipped", "before")
SHIPPED = gates.SpeculationGate.decided_early


def use(variant: str) -> None:
    """Put the rule of VARIANT in place (a class attribute: every gate built after)."""
    gates.SpeculationGate.decided_early = SHIPPED if variant == "shipped" else lambda self, pending: False


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": round(statistics.median(xs), 3), "iqr": [round(q[0], 3), round(q[2], 3)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smoke")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-tokens", default="128")
    ap.add_argument("--json")
    a = ap.parse_args()
    lengths = [int(x) for x in a.max_tokens.split(",")]
    bench = ShapeBench(a.shape, bits=4, prompt_tokens=512, max_tokens=max(lengths), workloads=["echo"],
                       reps=a.rounds, on_step=print)
    cell, base = Cell("echo", "mlxspec-pld"), Cell("echo", BASELINE)
    out = {"shape": a.shape, "rounds": a.rounds, "variants": list(VARIANTS), "lengths": {}}
    for n in lengths:
        for v in VARIANTS:  # warm-up
            use(v)
            bench.run(cell, n)
        bench.run(base, n)
        rows = {v: [] for v in VARIANTS}
        for r in range(a.rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for v in order:
                use(v)
                run = bench.run(cell, n)
                st = run.stats
                steps = st["verify_steps"] + st["plain_steps"]
                rows[v].append({"tps": run.tps, "tokens_per_step": len(run.tokens) / steps,
                                "first_draft": next((e["at_token"] for e in st["gate_events"] if e["enabled"]), None),
                                "identical": run.tokens == bench.scripts["echo"].continuation[:n]})
            stock = bench.run(base, n).tps
            for v in VARIANTS:
                rows[v][-1]["stock_tps"] = stock
            print(n, r, {v: round(rows[v][-1]["tps"], 1) for v in VARIANTS}, "stock", round(stock, 1))
        use("shipped")
        summary = {}
        for v in VARIANTS:
            summary[v] = {
                "tps": quartiles([x["tps"] for x in rows[v]]),
                "over_before": quartiles([x["tps"] / y["tps"] for x, y in zip(rows[v], rows["before"])]),
                "over_stock": quartiles([x["tps"] / x["stock_tps"] for x in rows[v]]),
                "tokens_per_step": quartiles([x["tokens_per_step"] for x in rows[v]]),
                "identical": all(x["identical"] for x in rows[v]),
            }
            print(n, v, json.dumps(summary[v]))
        out["lengths"][str(n)] = {"summary": summary, "rounds": rows}
        if a.json:  # after each length: a call cut off keeps the lengths done
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
