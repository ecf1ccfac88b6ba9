"""What a compiled graph saves a batch's verify forward (``engine/compiled_forward.py``): B rows x
W tokens over a ragged cache of rows of different lengths (512 + 8 i tokens), the forward built
op by op by mlx-lm's model code against the same forward replayed from one ``mx.compile`` graph
a shape. Pairs in turn (ABAB) on one cache: the graph's build, its launch (``mx.async_eval``)
and the whole waited forward, medians, ms, and the per-pair ratio of the waited forward. Each
forward keeps 1..W tokens a row (rows differently), so the cache grows as in generation and the
capacity crosses its 256-position steps. First, both ways on the same state: whether their
logits are equal, and their greedy tokens.

    python3 benchmarks/diag_compiled_forward.py [--shape qwen3-8b] [--rows 4] [--width 5] [--reps 12] [--json OUT]
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
from mlxspec.engine.batch_step import greedy_tokens
from mlxspec.engine.compiled_forward import CompiledForward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape)
    cache = ragged(model, args.rows, 500, vocab, 8)
    compiled = cache.compiled or CompiledForward(model)
    B, W = args.rows, args.width

    def inputs(r: int) -> mx.array:
        return mx.array([[(5 * i + j + 3 * r) % vocab for j in range(W)] for i in range(B)], mx.uint32)

    same = {}
    for name, way in (("compiled", compiled), ("op_by_op", None)):
        cache.compiled = way
        logits = cache.forward(inputs(0))[0]
        mx.eval(logits)
        same[name] = logits
        cache.rollback([W] * B)
    diff = mx.abs(same["compiled"].astype(mx.float32) - same["op_by_op"].astype(mx.float32)).max().item()
    tokens_equal = greedy_tokens(same["compiled"]).tolist() == greedy_tokens(same["op_by_op"]).tolist()
    times: dict[str, list[tuple[float, float, float]]] = {"compiled": [], "op_by_op": []}
    for r in range(args.reps + 1):  # the first pair warms up
        for name, way in (("compiled", compiled), ("op_by_op", None)):
            cache.compiled = way
            x = inputs(r)
            mx.eval(x)
            took = timed_forward(cache, x)
            cache.rollback([W - 1 - (i + r) % W for i in range(B)])  # keep 1..W tokens a row
            mx.eval([c.state for c in cache.layers])
            if r:
                times[name].append(took)
    cache.compiled = compiled
    out = {"shape": args.shape, "rows": B, "width": W, "reps": args.reps, "logits_max_abs_diff": diff,
           "greedy_tokens_equal": tokens_equal, "graphs_traced": compiled.traced,
           "ends_after": cache.layers[0].ends, **ab_summary(times, "compiled", "op_by_op")}
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
