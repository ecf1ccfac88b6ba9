"""Interleaved forward timings of a real shape (1, 2, 4 and 8 tokens; synchronous and queued)
under small-M matmul policies, round-robin so the machine's drift hits every policy alike:

- ``kernel``: mlxspec's small-M kernel at 2..8 rows on every matrix;
- ``kernel-4mb`` / ``kernel-16mb``: the same for matrices of at least 4 / 16 MB (smaller ones
  on MLX's matmul);
- ``qmv``: MLX's matmul at every row count (its qmv path below 8 rows);
- ``pad8``: rows padded to 8, MLX's tensor-core path.

    python benchmarks/diag_verify_strategies.py SHAPE [ROUNDS] [OUT.json] [POLICY,...]

The per-shape timing policy the results' ``current`` rows stand for (each matrix timed alone at
load) is qmm.py as of commit 6d305a5; it is no longer in the package. Earlier result files name
the policies ours_all, ours_4mb, ours_16mb and mlx (= kernel, kernel-4mb, kernel-16mb, qmv).
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.kernels import qmm

ROWS = (1, 2, 4, 8)


def pad8(module, x, kernel=None):  # KERNEL: the one the layer chose, replaced here
    K = x.shape[-1]
    rows = x.size // K
    flat = x.reshape(rows, K)
    if rows < 8:
        flat = mx.concatenate([flat, mx.zeros((8 - rows, K), x.dtype)])
    y = mx.quantized_matmul(flat, module["weight"], module["scales"], module["biases"], transpose=True,
                            group_size=module.group_size, bits=module.bits)[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


# policy -> (the small-M path's matmul, the smallest matrix it takes)
POLICIES = {"kernel": (qmm._matmul, 0), "kernel-4mb": (qmm._matmul, 4 << 20),
            "kernel-16mb": (qmm._matmul, 16 << 20), "qmv": (qmm._matmul, 1 << 62), "pad8": (pad8, 0)}


def forward_ms(model, tokens, cache, queued: bool) -> float:
    """One synchronous forward, or five queued back to back (ms each)."""
    t0 = time.perf_counter()
    if not queued:
        mx.eval(model(tokens[0], cache=cache))
        return (time.perf_counter() - t0) * 1e3
    outs = []
    for t in tokens[:5]:
        y = model(t, cache=cache)
        mx.async_eval(y)
        outs.append(y)
    mx.eval(outs)
    return (time.perf_counter() - t0) / 5 * 1e3


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    out_path = sys.argv[3] if len(sys.argv) > 3 else None
    chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else ["kernel", "kernel-4mb", "kernel-16mb", "qmv"]
    model = random_model(shape, bits=4)
    vocab = vocab_size(shape)
    matmul, limit = qmm._matmul, qmm.MIN_WEIGHT_BYTES
    caches = {}
    for name in chosen:
        caches[name] = make_prompt_cache(model)
        mx.eval(model(mx.random.randint(0, vocab, (1, 512)), cache=caches[name]))
    times = {n: {f"{m}_{L}": [] for m in ("sync", "queued") for L in ROWS} for n in chosen}
    toks = {L: [mx.random.randint(0, vocab, (1, L)) for _ in range(8)] for L in ROWS}
    mx.eval(toks)
    for r in range(rounds + 2):  # the first two rounds warm up
        for name in chosen:
            qmm._matmul, qmm.MIN_WEIGHT_BYTES = POLICIES[name]
            for L in ROWS:
                for mode in ("sync", "queued"):
                    ms = forward_ms(model, toks[L], caches[name], mode == "queued")
                    if r >= 2:
                        times[name][f"{mode}_{L}"].append(ms)
            for c in caches[name]:  # keep the key length about constant (attention caches)
                if getattr(c, "offset", 0) > 700 and c.is_trimmable():
                    c.trim(c.offset - 600)
    qmm._matmul, qmm.MIN_WEIGHT_BYTES = matmul, limit
    res = {"shape": shape, "rounds": rounds, "device": mx.device_info().get("device_name")}
    for name, d in times.items():
        med = {k: round(statistics.median(v), 3) for k, v in d.items()}
        for L in ROWS[1:]:
            med[f"ratio_sync_{L}"] = round(med[f"sync_{L}"] / med["sync_1"], 3)
            med[f"ratio_queued_{L}"] = round(med[f"queued_{L}"] / med["queued_1"], 3)
        res[name] = med
        print(name, json.dumps(med), flush=True)
    if out_path:
        Path(out_path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
