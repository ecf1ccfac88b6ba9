"""How a verify and a plain token grow with the context, over padded and prefilled caches.

For each length: waited forwards of 1, 2 and 4 tokens (fastest of REPS, ms) and a pipelined
plain token (costs.plain_factor's loop, ms), over a cache padded with placeholder positions
(``ModelState.pad``, what ``engine/context_cost.py`` times) and, up to --prefill-max, over a
cache really prefilled: the padded timing stands for the real one where they agree.

    python3 benchmarks/diag_context_cost.py --shape qwen3-8b --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.cache import ModelState
from mlxspec.engine.costs import PLAIN_CONTEXT, plain_factor


def waited(state: ModelState, n: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        tokens = mx.array([(3 * i + n) % 1000 for i in range(n)], mx.uint32)
        t0 = time.perf_counter()
        mx.eval(state.forward(tokens))
        best = min(best, time.perf_counter() - t0)
        state.rollback_to(state.length - n + 1)
        state.commit()
    return best * 1e3


def row(model, length: int, how: str, reps: int, vocab: int) -> dict:
    state = ModelState(model)
    if how == "padded":
        state.prefill([(7 * i) % vocab for i in range(16)])
        state.pad(length - 16)
    else:
        state.prefill([(7 * i) % vocab for i in range(length)])
    waited(state, 1, 2)  # warm-up
    out = {"length": length, "how": how, **{f"waited_{n}": round(waited(state, n, reps), 3) for n in (1, 2, 4)}}
    del state
    one = out["waited_1"] / 1e3
    out["plain"] = round(plain_factor(model, one, vocab, pad_to=length if length > PLAIN_CONTEXT else None,
                                      cap=10.0) * one * 1e3, 3)
    mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--lengths", default="128,1024,4096,8192,16384,32768")
    ap.add_argument("--prefill-max", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    vocab = vocab_size(a.shape)
    model = random_model(a.shape)
    rows = []
    for r in range(a.rounds):
        for length in [int(x) for x in a.lengths.split(",")]:
            for how in ("padded", "prefilled"):
                if how == "prefilled" and length > a.prefill_max:
                    continue
                rows.append({"round": r, **row(model, length, how, a.reps, vocab)})
                print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
