"""Interleaved forward timings of a real shape (1 and 4 tokens, synchronous and queued) under
small-M matmul strategies: current kernel choice, rows padded to 8 for MLX's tensor-core path,
MLX's qmv for every row count. Round-robin so machine drift hits every strategy alike."""
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

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
out_path = sys.argv[3] if len(sys.argv) > 3 else None
model = random_model(shape, bits=4)
vocab = vocab_size(shape)
orig_matmul, orig_use = qmm._matmul, qmm._use

def pad8(module, x):
    K = x.shape[-1]
    rows = x.size // K
    x2 = mx.concatenate([x.reshape(rows, K), mx.zeros((8 - rows, K), x.dtype)]) if rows < 8 else x.reshape(rows, K)
    y = mx.quantized_matmul(x2, module["weight"], module["scales"], module["biases"], transpose=True,
                            group_size=module.group_size, bits=module.bits)[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])

def builtin(module, x):
    return mx.quantized_matmul(x, module["weight"], module["scales"], module["biases"], transpose=True,
                               group_size=module.group_size, bits=module.bits)

def threshold(limit):
    def use(module, x):
        qmm.MIN_WEIGHT_BYTES = limit
        return orig_use(module, x)
    return use


STRATS = {"ours_all": (orig_matmul, threshold(0)), "ours_4mb": (orig_matmul, threshold(4 << 20)),
          "ours_16mb": (orig_matmul, threshold(16 << 20)), "mlx": (orig_matmul, threshold(1 << 62))}
caches = {}
for name in STRATS:
    c = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, vocab, (1, 512)), cache=c))
    caches[name] = c
LS = (1, 2, 4, 8)
times = {n: {f"{m}_{L}": [] for m in ("sync", "queued") for L in LS} for n in STRATS}
toks = {L: [mx.random.randint(0, vocab, (1, L)) for _ in range(8)] for L in LS}
mx.eval(toks)
for r in range(rounds + 2):
    for name, (mm, use) in STRATS.items():
        qmm._matmul, qmm._use = mm, use
        c = caches[name]
        for L in LS:
            t0 = time.perf_counter()
            mx.eval(model(toks[L][0], cache=c))
            dt = time.perf_counter() - t0
            if r >= 2:
                times[name][f"sync_{L}"].append(dt * 1e3)
            t0 = time.perf_counter()
            outs = []
            for t in toks[L][:5]:
                y = model(t, cache=c)
                mx.async_eval(y)
                outs.append(y)
            mx.eval(outs)
            dt = (time.perf_counter() - t0) / 5
            if r >= 2:
                times[name][f"queued_{L}"].append(dt * 1e3)
        for layer_cache in c:  # keep the key length about constant (attention caches)
            if hasattr(layer_cache, "trim") and getattr(layer_cache, "offset", 0) > 700 and layer_cache.is_trimmable():
                layer_cache.trim(layer_cache.offset - 600)
qmm._matmul, qmm._use = orig_matmul, orig_use
res = {"shape": shape, "rounds": rounds, "device": mx.device_info().get("device_name")}
for n, d in times.items():
    med = {k: round(statistics.median(v), 3) for k, v in d.items()}
    for L in LS[1:]:
        med[f"ratio_sync_{L}"] = round(med[f"sync_{L}"] / med["sync_1"], 3)
        med[f"ratio_queued_{L}"] = round(med[f"queued_{L}"] / med["queued_1"], 3)
    res[n] = med
    print(n, json.dumps(med), flush=True)
if out_path:
    Path(out_path).write_text(json.dumps(res, indent=1))
