"""q/k/v and gate/up stacked into one small-M call each (mlxspec/kernels/qmm_groups.py) against
one call per matrix: forwards of 1, 2, 4 and 8 tokens over a growing cache, the two models
built from the same seed and timed in alternating rounds so the machine's drift hits both.

    python benchmarks/diag_stacked.py SHAPE [ROUNDS] [OUT.json]
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx

from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.costs import verify_times
from mlxspec.kernels import qmm_groups

WIDTHS = (2, 4, 8)


def build(shape: str, stacked: bool):
    if stacked:
        return random_model(shape, bits=4)
    install = qmm_groups.install
    qmm_groups.install = lambda model: 0
    try:
        return random_model(shape, bits=4)
    finally:
        qmm_groups.install = install


def main() -> None:
    shape = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    models = {"stacked": build(shape, True), "per-matrix": build(shape, False)}
    vocab = vocab_size(shape)
    samples = {name: {n: [] for n in (1,) + WIDTHS} for name in models}
    for r in range(rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            times = verify_times(models[name], WIDTHS, context=256, reps=3, vocab=vocab, warmup_each=True)
            for n, t in times.items():
                samples[name][n].extend(t)
    out = {"shape": shape, "rounds": rounds, "device": mx.device_info().get("device_name", str(mx.default_device()))}
    for name, per_width in samples.items():
        ms = {n: round(1e3 * statistics.median(t), 3) for n, t in per_width.items()}
        best = {n: round(1e3 * min(t), 3) for n, t in per_width.items()}
        out[name] = {"median_ms": ms, "min_ms": best,
                     "ratio_median": {n: round(ms[n] / ms[1], 3) for n in WIDTHS},
                     "ratio_min": {n: round(best[n] / best[1], 3) for n in WIDTHS}}
        print(name, out[name])
    if len(sys.argv) > 3:
        Path(sys.argv[3]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
