"""What a compiled graph saves a batch's verify forward (``engine/compiled_forward.py``): B rows x
W tokens over a ragged cache of rows of different lengths (512 + 8 i tokens), the forward built
op by op by mlx-lm's model code against the same forward replayed from one ``mx.compile`` graph
a shape. Pairs in turn (ABAB) on one cache: the graph's build, its launch (``mx.async_eval``)
and the whole waited forward, medians, ms, and the per-pair ratio of the waited forward. Each
forward keeps 1..W tokens a row (rows differently), so the cache grows as in generation and the
capacity crosses its 256-position steps. First, both ways on the same state: whether their
logits are equal, and their greedy tokens.

One row (``--rows 1``): a request alone keeps mlx-lm's ``KVCache`` (the single-request loop's
verify), so the op-by-op way runs over that and the compiled way over a copy of the row in a
one-row ragged cache: what compiling a single request's verify would save. ``--widths`` runs
several widths on one model, a JSON line each.

    python3 benchmarks/diag_compiled_forward.py [--shape qwen3-8b] [--rows 4] [--widths 5] [--reps 12] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.diag_batch_forward import ragged
from benchmarks.diag_ragged_nodes import ab_summary, timed_forward
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.batch_cache import RaggedCache
from mlxspec.engine.batch_step import greedy_tokens
from mlxspec.engine.compiled_forward import CompiledForward
from mlxspec.engine.ragged_kv import RaggedKVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--widths", default="5", help="comma-separated widths, each timed in turn")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape)
    lines = [cell(model, vocab, args.rows, int(w), args.reps) | {"shape": args.shape}
             for w in args.widths.split(",")]
    for line in lines:
        print(json.dumps(line))
    if args.json:
        args.json.write_text(json.dumps(lines if len(lines) > 1 else lines[0], indent=1))


def one_row_ragged(cache: RaggedCache) -> RaggedCache:
    """A copy of CACHE's one row (its own KV caches) as a one-row ragged cache."""
    copy = RaggedCache(cache.model)
    copy.layers = [RaggedKVCache.of_rows([c]) for c in cache.layers]
    offset = copy.layers[0].offset
    for c in copy.layers:
        c.offset = offset
    mx.eval([c.state for c in copy.layers])
    return copy


def cell(model, vocab: int, B: int, W: int, reps: int) -> dict:
    cache = ragged(model, B, 500, vocab, 8)
    compiled = cache.compiled or CompiledForward(model)
    ways = {"compiled": (one_row_ragged(cache) if B == 1 else cache, compiled), "op_by_op": (cache, None)}

    def inputs(r: int) -> mx.array:
        return mx.array([[(5 * i + j + 3 * r) % vocab for j in range(W)] for i in range(B)], mx.uint32)

    same = {}
    for name, (c, way) in ways.items():
        c.compiled = way
        logits = c.forward(inputs(0))[0]
        mx.eval(logits)
        same[name] = logits
        c.rollback([W] * B)
    diff = mx.abs(same["compiled"].astype(mx.float32) - same["op_by_op"].astype(mx.float32)).max().item()
    tokens_equal = greedy_tokens(same["compiled"]).tolist() == greedy_tokens(same["op_by_op"]).tolist()
    times: dict[str, list[tuple[float, float, float]]] = {"compiled": [], "op_by_op": []}
    for r in range(reps + 1):  # the first pair warms up
        for name, (c, way) in ways.items():
            c.compiled = way
            x = inputs(r)
            mx.eval(x)
            took = timed_forward(c, x)
            c.rollback([W - 1 - (i + r) % W for i in range(B)])  # keep 1..W tokens a row
            mx.eval([layer.state for layer in c.layers])
            if r:
                times[name].append(took)
    ends = getattr(cache.layers[0], "ends", None) or [cache.layers[0].offset]
    return {"rows": B, "width": W, "reps": reps, "logits_max_abs_diff": diff,
            "greedy_tokens_equal": tokens_equal, "graphs_traced": compiled.traced,
            "ends_after": ends, **ab_summary(times, "compiled", "op_by_op")}

if __name__ == "__main__":
    main()
