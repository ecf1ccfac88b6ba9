"""Where a verify forward's extra cost goes: forwards of 1, 2 and 4 tokens of a real shape over a
growing cache, with parts of the 2..16-row path skipped (timing only: the outputs are wrong),
round-robin so the machine's drift hits every variant alike:

- ``full``: as shipped (mlxspec's small-M matmul and verify attention);
- ``no-attn``: verify attention returns its queries (no attention work at 2+ rows);
- ``no-qmm``: the small-M matmuls return zeros (no matmul work at 2..8 rows, lm_head too);
- ``neither``: both skipped: what the rest of the forward (norms, RoPE, casts, host) costs;
- ``stock``: MLXSPEC_KERNELS=0, MLX's own kernels;
- ``colsN``: as shipped, with the small-M kernel computing N output columns a warp (1, 2, 8;
  shipped: qmm.COLS).

    python benchmarks/diag_verify_parts.py SHAPE [ROUNDS] [OUT.json] [VARIANT,...]
"""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx

from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.costs import verify_times
from mlxspec.kernels import ENV, attention, qmm

WIDTHS = (2, 4)
REAL = {"attn": attention.verify_attention, "qmm": qmm._matmul, "cols": qmm.COLS}


def skip_attn(queries, keys, values, scale, mask):
    return queries


def skip_qmm(module, x):
    return mx.zeros(x.shape[:-1] + (module["weight"].shape[0],), x.dtype)


def variant(name: str) -> None:
    attention.verify_attention = skip_attn if name in ("no-attn", "neither") else REAL["attn"]
    qmm._matmul = skip_qmm if name in ("no-qmm", "neither") else REAL["qmm"]
    qmm.COLS = int(name[4:]) if name.startswith("cols") else REAL["cols"]
    if name == "stock":
        os.environ[ENV] = "0"
    else:
        os.environ.pop(ENV, None)


def main() -> None:
    shape = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    model = random_model(shape, bits=4)
    vocab = vocab_size(shape)
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else ["full", "no-attn", "no-qmm", "neither", "stock"]
    samples = {name: {n: [] for n in (1,) + WIDTHS} for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            variant(name)
            for n, t in verify_times(model, WIDTHS, context=256, reps=3, vocab=vocab, warmup_each=True).items():
                samples[name][n].extend(t)
    variant("full")
    out = {"shape": shape, "rounds": rounds, "device": mx.device_info().get("device_name", "")}
    for name, per_width in samples.items():
        ms = {n: round(1e3 * statistics.median(t), 3) for n, t in per_width.items()}
        out[name] = {"median_ms": ms, "ratio": {n: round(ms[n] / ms[1], 3) for n in WIDTHS}}
        print(name, out[name])
    if len(sys.argv) > 3:
        Path(sys.argv[3]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
