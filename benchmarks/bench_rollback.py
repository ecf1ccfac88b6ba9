"""Cost of a partial accept on a hybrid (GatedDeltaNet) model: tape replay vs re-forward.

Random 4-bit weights in a Qwen3.5-9B-like shape (hidden 4096, 32 layers, 3 of 4 linear).
For verify widths n = 2, 4, 8: time the verify forward, then the rollback to 1 kept token by
(a) tape replay (mlxspec's default for Qwen3.5 GatedDeltaNet) and (b) snapshot restore plus a
re-forward of the kept token (the generic path). Median of --reps.

    python benchmarks/bench_rollback.py --reps 7 --out rollback.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.bench.synthetic import random_model  # noqa: E402
from mlxspec.engine.cache import ModelState  # noqa: E402


def random_hybrid(shape: str, bits: int) -> nn.Module:
    return random_model(shape, vocab=32000, bits=bits)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-9b-like")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print("mlx", mx.__version__, mx.default_device(), flush=True)
    model = random_hybrid(a.shape, a.bits)
    context = [(13 * i) % 30000 for i in range(256)]
    rows = []
    for n in (2, 4, 8):
        res = {"width": n, "verify_ms": [], "tape_rollback_ms": [], "reforward_rollback_ms": []}
        for rep in range(a.reps + 1):  # the first repetition warms up
            for method in ("tape", "reforward"):
                st = ModelState(model)
                st.prefill(context)
                if method == "reforward":
                    st._taped = None  # the generic snapshot + re-feed path
                toks = mx.array([(7 * i + n) % 30000 for i in range(n)], mx.uint32)
                v = timed(lambda: mx.eval(st.forward(toks)))
                r = timed(lambda: (st.rollback_to(len(context) + 1), mx.eval([c.state for c in st.cache])))
                if rep:
                    if method == "tape":
                        res["verify_ms"].append(v * 1e3)
                    res[f"{method}_rollback_ms"].append(r * 1e3)
        row = {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in res.items()}
        rows.append(row)
        print(json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"shape": a.shape, "bits": a.bits, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
