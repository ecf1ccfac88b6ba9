"""A single request's verify compiled or op by op (``engine/compiled_forward.py``,
``MLXSPEC_COMPILED_VERIFY``), as the loop runs it: ``ModelState.forward`` of W tokens over the
request's own KV caches at a context of C tokens (a short prefill, then ``ModelState.pad``),
waited for, then rolled back. The two ways alternate (ABAB) on one state; per way and cell the
median ms, the per-pair ratio compiled / op by op (median, IQR), and the memory the verify
needs past what the caches hold (a compiled graph that copied its caches instead of writing
into them would show the caches' size here). Width 1 is a plain step (``MLXSPEC_COMPILED_PLAIN``).

    python3 benchmarks/diag_compiled_verify.py [--shape qwen3-8b] [--contexts 1024,32768]
        [--widths 2,4,9] [--reps 10] [--attention-only] [--decode N] [--json OUT]

--attention-only leaves a GatedDeltaNet hybrid's verifies op by op (``=kv``); by default they
are compiled. --decode N also times plain decoding as a user's ``--drafter none`` run does it (the
loop, its steps pipelined as mlx-lm pipelines them) for N tokens from a 512-token prompt, its
one-token steps compiled or op by op, REPS ABAB pairs: tok/s each way and the per-pair ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.engine import compiled_forward
from mlxspec.engine.cache import ModelState


def waited(state: ModelState, tokens: mx.array) -> tuple[float, int]:
    """(seconds for the forward to its logits, bytes of peak memory over the active before it)."""
    mx.eval(tokens)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    mx.eval(state.forward(tokens))
    took = time.perf_counter() - t0
    extra = mx.get_peak_memory() - base
    state.rollback_to(state.length - tokens.shape[0])
    mx.eval([c.state for c in state.cache])
    return took, extra


def cell(state: ModelState, vocab: int, width: int, reps: int) -> dict:
    times = {"compiled": [], "op_by_op": []}
    extra = {"compiled": 0, "op_by_op": 0}
    for r in range(reps + 1):  # the first pair warms up (and traces)
        for name in ("compiled", "op_by_op"):
            compiled_forward.row_verify = name == "compiled"
            tokens = mx.array([(7 * r + 3 * j + 1) % vocab for j in range(width)], mx.uint32)
            took, more = waited(state, tokens)
            if r:
                times[name].append(took)
                extra[name] = max(extra[name], more)
    compiled_forward.row_verify = True
    ratios = sorted(a / b for a, b in zip(times["compiled"], times["op_by_op"]))
    q = statistics.quantiles(ratios, n=4)
    return {"width": width, "reps": reps,
            **{f"{k}_ms": round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
            **{f"{k}_extra_mb": round(v / 2**20, 1) for k, v in extra.items()},
            "ratio": round(statistics.median(ratios), 3), "ratio_iqr": [round(q[0], 3), round(q[2], 3)]}


def decode_cell(model, vocab: int, tokens: int, reps: int) -> dict:
    """Plain decoding through the loop, its one-token steps compiled or op by op, ABAB."""
    from mlxspec.engine.sampling import SamplingParams
    from mlxspec.engine.speculate import SpeculativeDecoder

    prompt = [(5 * t + 1) % vocab for t in range(512)]
    tps = {"compiled": [], "op_by_op": []}
    outputs = {}
    for r in range(reps + 1):  # the first pair warms up (and traces)
        for name in ("compiled", "op_by_op"):
            compiled_forward.plain_steps = name == "compiled"
            dec = SpeculativeDecoder(model, drafter="none")
            out, stamps = [], []
            for new, _ in dec.generate(prompt, sampling=SamplingParams(0.0), max_tokens=tokens):
                out.extend(new)
                stamps.append(time.perf_counter())
            if r:
                tps[name].append((len(out) - 1) / (stamps[-1] - stamps[0]))
            outputs[name] = out
    compiled_forward.plain_steps = True
    ratios = sorted(a / b for a, b in zip(tps["compiled"], tps["op_by_op"]))
    q = statistics.quantiles(ratios, n=4)
    same = sum(a == b for a, b in zip(outputs["compiled"], outputs["op_by_op"]))
    return {"decode_tokens": tokens, "reps": reps,
            **{f"{k}_tps": round(statistics.median(v), 2) for k, v in tps.items()},
            "ratio": round(statistics.median(ratios), 3), "ratio_iqr": [round(q[0], 3), round(q[2], 3)],
            "same_tokens": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--widths", default="2,4,9")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--attention-only", action="store_true", help="leave a GatedDeltaNet hybrid's verifies op by op")
    ap.add_argument("--decode", type=int, default=0, help="also time plain decoding of this many tokens")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    compiled_forward.hybrid_verify = not args.attention_only
    vocab = vocab_size(args.shape)
    model = random_model(args.shape)
    out = []
    for context in (int(c) for c in args.contexts.split(",")):
        state = ModelState(model)
        if not state.compiles_verifies:
            raise SystemExit(f"{args.shape}'s verifies are not compiled here")
        state.prefill([(5 * t + 1) % vocab for t in range(256)])
        if not state.pad(context - 256):
            raise SystemExit(f"cannot pad {args.shape}'s caches to {context} tokens")
        kv_mb = round(sum(c.keys.nbytes + c.values.nbytes for c in state.cache if hasattr(c, "keys")) / 2**20, 1)
        for width in (int(w) for w in args.widths.split(",")):
            line = {"shape": args.shape, "context": context, "kv_mb": kv_mb, **cell(state, vocab, width, args.reps)}
            print(json.dumps(line), flush=True)
            out.append(line)
        del state
        mx.clear_cache()
    if args.decode:
        line = {"shape": args.shape, **decode_cell(model, vocab, args.decode, args.reps)}
        print(json.dumps(line), flush=True)
        out.append(line)
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "cells": out}, indent=1))


if __name__ == "__main__":
    main()
