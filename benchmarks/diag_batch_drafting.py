"""What drafting a batch's rows together saves: `mlxspec batched` with the rows' MTP heads
drafting together (one head forward commits every row's pairs, one a draft position serves
every row's chain: ``MTPDrafter.propose_together``) against the same engine with each row
drafting alone (``BatchedDecoder(draft_together=False)``), ABAB, on a real shape's random
weights with the scripted target and steered head of ``bench --real-shapes --concurrency``.

    python3 benchmarks/diag_batch_drafting.py --shape qwen3-8b --rows 4 --reps 8 --json out.json

Both runs of a repetition must give every request's script (``identical``); the ratio is
together over alone, aggregate tok/s, paired per repetition (median and interquartile range,
``bench.paired``).
"""

import argparse
import json

from mlxspec.bench.paired import paired_speedup, quartiles
from mlxspec.bench.real_concurrency import ConcurrencyBench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--workload", default="mtp-like")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()
    bench = ConcurrencyBench(a.shape, bits=a.bits, prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens,
                             workloads=[a.workload], requests=a.rows, reps=a.reps, on_step=print, stock=False)
    bench.follow(a.workload)
    scripts = bench.scripts[a.workload][: a.rows]
    want = [s.continuation[: a.max_tokens] for s in scripts]

    def run(together):
        return bench._batched(a.workload, scripts, True, together=together)

    run(True), run(False)  # warm-up
    tps, stats, identical = {True: [], False: []}, {True: [], False: []}, True
    for rep in range(a.reps):
        for together in ((True, False) if rep % 2 == 0 else (False, True)):
            r = run(together)
            identical &= [t[: a.max_tokens] for t in r.tokens] == want
            tps[together].append(r.aggregate_tps)
            stats[together].append(r.stats)
    out = {"shape": a.shape, "rows": a.rows, "workload": a.workload, "reps": a.reps, "bits": a.bits,
           "identical": identical, "together_over_alone": paired_speedup(tps[True], tps[False]),
           "together_tps": [round(q, 1) for q in quartiles(tps[True])],
           "alone_tps": [round(q, 1) for q in quartiles(tps[False])],
           "together_stats": stats[True][-1], "alone_stats": stats[False][-1]}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
