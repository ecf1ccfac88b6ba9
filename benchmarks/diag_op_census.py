"""How many MLX operations one forward of B rows x W tokens puts in its graph, by primitive: on
CUDA every one is built and encoded by the host (a verify step there is host-bound,
``diag_host_bound.py``), so the census says which ones a fused kernel could remove. The forward
runs over the batch's ragged cache (``batch_cache.RaggedCache``) with the greedy tokens read
after it, as a batched verify step builds it; nothing is evaluated.

    python3 benchmarks/diag_op_census.py [--shape qwen3-8b] [--cells 1x1,1x5,4x5] [--context 512]
        [--spread 0] [--json OUT]

Note: a prefill of exactly a multiple of 256 tokens leaves the cache full, so the first write
grows every layer's keys and values (a Full and a Concatenate each): use a context of, say, 500.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import re
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.diag_batch_forward import ragged
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine.batch_step import greedy_tokens


def census(*outs: mx.array) -> collections.Counter:
    """Primitives in the graph of OUTS, by name (``mx.export_to_dot``'s operation nodes)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outs)
    labels = re.findall(r'\[label\s*=\s*"([^"]+)"', dot.getvalue())
    return collections.Counter(label.split()[0] for label in labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--cells", default="1x1,1x5,4x5")
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--spread", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    vocab = vocab_size(args.shape)
    model = random_model(args.shape)
    out = {"shape": args.shape, "context": args.context, "spread": args.spread, "cells": []}
    for cell in args.cells.split(","):
        rows, width = (int(v) for v in cell.split("x"))
        cache = ragged(model, rows, args.context, vocab, args.spread)
        mx.eval([c.state for c in cache.layers])
        x = mx.array([[(5 * i + j) % vocab for j in range(width)] for i in range(rows)], mx.uint32)
        ops = census(greedy_tokens(cache.forward(x)[0]))
        row = {"rows": rows, "width": width, "operations": sum(ops.values()), "by_primitive": dict(ops.most_common())}
        out["cells"].append(row)
        print(json.dumps(row), flush=True)
        del cache
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
