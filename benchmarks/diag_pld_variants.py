"""Prompt lookup on the echo script with and without its two later rules, interleaved in one
process (for the GPU machine): is more tokens a step also more tokens a second?

    python3 benchmarks/diag_pld_variants.py --shape qwen3-8b --rounds 12 --max-tokens 128,512

Variants, each the ``mlxspec-pld`` cell of ``mlxspec bench --real-shapes`` on one model:
- ``both``: as shipped (the substitution lookup of ``drafters/pld.py`` and the gate deciding
  early on a shadow proposal, ``SpeculationGate.decided_early``);
- ``substitution``: the gate settles a shadow proposal only once it has passed whole;
- ``neither``: no substitution lookup either (the lookup before both).
Each round runs every variant once, in a rotated order, then stock mlx-lm (its own process).
Per round: each variant's tok/s over ``neither``'s in the same round (paired), and over stock.
"""

import argparse
import json
import statistics

from mlxspec.bench.real_shapes import BASELINE, Cell, ShapeBench
from mlxspec.engine import gates
from mlxspec.engine.drafters import pld

VARIANTS = ("both", "substitution", "neither")
SHIPPED = (pld.PromptLookupDrafter._after_substitution, gates.SpeculationGate.decided_early)


def use(variant: str) -> None:
    """Put the rules of VARIANT in place (class attributes: every drafter and gate built after)."""
    lookup, early = SHIPPED
    if variant in ("substitution", "neither"):
        early = lambda self, pending: False  # noqa: E731
    if variant == "neither":
        lookup = lambda self, tokens, k: []  # noqa: E731
    pld.PromptLookupDrafter._after_substitution = lookup
    gates.SpeculationGate.decided_early = early


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
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
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
        use("both")
        summary = {}
        for v in VARIANTS:
            summary[v] = {
                "tps": quartiles([x["tps"] for x in rows[v]]),
                "over_neither": quartiles([x["tps"] / y["tps"] for x, y in zip(rows[v], rows["neither"])]),
                "over_stock": quartiles([x["tps"] / x["stock_tps"] for x in rows[v]]),
                "tokens_per_step": quartiles([x["tokens_per_step"] for x in rows[v]]),
                "identical": all(x["identical"] for x in rows[v]),
            }
            print(n, v, json.dumps(summary[v]))
        out["lengths"][str(n)] = {"summary": summary, "rounds": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
