"""A batch's wide verify on a real shape: the tensor-core quantized matmul
(``kernels/qmm_tc.py``) against MLX's and the small-M kernel, alone and in whole forwards.

1. Matmuls alone, on the shape's matrices of at least the kernels' size limit, at 1..32 rows:
   MLX's ``mx.quantized_matmul``, the small-M kernel (up to its compiled rows) and the
   tensor-core kernel (16 or 32 columns a warp). Each timing evaluates a graph of 48 matmuls
   cycling over 6 copies of the matrix, so most weights come from memory as in a forward (the
   4096 x 4096 matrix's 6 copies, 48 MB, about fill the L2); microseconds a matmul, median of 5
   rounds. The largest difference from MLX's output, relative to its largest value, is reported.
2. Whole forwards of the model at widths 1..32, round-robin over ``--policies``: ``mlx`` (2..8
   rows on the small-M kernel, more on MLX's matmul), ``small-m`` (2..8 on the small-M kernel,
   9..32 on the tensor-core kernel) and ``tc`` (2..32 on the tensor-core kernel, the default);
   milliseconds a synchronous forward over a ~600-token cache, median of the rounds, and of
   building its graph alone (``build_ms``: the host's share, before anything runs). ``tc1``
   also sends decode's 1 row to the tensor-core kernel; ``off`` runs with every mlxspec kernel
   switched off (MLX's own, as stock; its 2+ rows pay MLX's attention graph builds).
3. ``--decode N``: plain decoding as users run it (mlx-lm's pipelined ``generate_step``, the
   next token's forward queued before the current one is read) under each policy, N tokens
   after a 512-token prompt, round-robin; tokens/s a round, median and quartiles.

    python benchmarks/diag_wide_verify.py [--shape qwen3-8b] [--rounds 15] [--skip-matmuls]
        [--policies mlx,small-m,tc,tc1] [--decode N] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.bench.synthetic import random_model, vocab_size
from mlxspec.kernels import qmm, qmm_tc
from mlxspec.kernels.switch import switched_off

ROWS = (1, 2, 4, 8, 9, 12, 16, 20, 24, 32)
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32)
# policy -> the rows the tensor-core kernel takes (the small-M kernel takes 2..8 rows it does not)
POLICIES = {"mlx": range(0), "small-m": range(qmm.MAX_ROWS + 1, qmm_tc.MAX_ROWS + 1),
            "tc": range(qmm.MIN_ROWS, qmm_tc.MAX_ROWS + 1), "tc1": range(1, qmm_tc.MAX_ROWS + 1), "off": range(0)}
CALLS, COPIES = 48, 6


def matrices(model: nn.Module, keep=lambda m: m["weight"].nbytes >= qmm.MIN_WEIGHT_BYTES) -> dict:
    """One quantized layer per distinct (out, in) shape that KEEP takes (by default: of at least
    the kernels' size limit)."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear) and keep(m):
            key = f"{m['weight'].shape[0]}x{m['weight'].shape[1] * 32 // m.bits}"
            found.setdefault(key, m)
    return found


def paths(rows: int) -> list[str]:
    """The paths that take this many rows."""
    small = ["smallm"] if rows <= qmm.MAX_ROWS else []
    return ["mlx", *small, "tc16", "tc32"]


def matrix_copies(layer) -> list[tuple]:
    """COPIES evaluated copies of LAYER's (weight, scales, biases): graphs cycling over them read
    most weights from memory, as a forward does."""
    copies = [(mx.array(layer["weight"]) + 0, layer["scales"] + 0, layer["biases"] + 0) for _ in range(COPIES)]
    mx.eval(copies)
    return copies


def relative_error(got: mx.array, ref: mx.array) -> float:
    """The largest difference from REF relative to REF's largest value."""
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return (mx.max(mx.abs(got - ref)) / mx.maximum(mx.max(mx.abs(ref)), 1e-6)).item()


def microseconds_a_call(fns: dict, copies: list[tuple], rounds: int) -> dict:
    """Each of FNS (name -> f(w, s, b)) timed over graphs of CALLS calls cycling over COPIES,
    round-robin, after a warm-up round: name -> median microseconds a call."""
    us = {name: [] for name in fns}
    for r in range(rounds + 1):
        for name, f in fns.items():
            t0 = time.perf_counter()
            mx.eval([f(*copies[i % COPIES]) for i in range(CALLS)])
            if r:
                us[name].append((time.perf_counter() - t0) / CALLS * 1e6)
    return {name: statistics.median(v) for name, v in us.items()}


def time_matmuls(layer, rows: int, rounds: int) -> dict:
    K = layer["weight"].shape[1] * 32 // layer.bits
    x = mx.random.normal((rows, K)).astype(layer["scales"].dtype)
    mx.eval(x)
    copies = matrix_copies(layer)
    fns = {name: functools.partial(_call, name, layer, x) for name in paths(rows)}
    ref = fns["mlx"](*copies[0])
    us = microseconds_a_call(fns, copies, rounds)
    return {n: {"max_rel_err": round(relative_error(f(*copies[0]), ref), 5), "us": round(us[n], 2)}
            for n, f in fns.items()}


def _call(name: str, layer, x, w, s, b):
    gs, bits = layer.group_size, layer.bits
    if name == "mlx":
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)
    if name == "smallm":
        return qmm.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
    return qmm_tc.quantized_matmul(x, w, s, b, group_size=gs, bits=bits, col_tiles=int(name[2:]) // 16)


def time_forwards(model, vocab: int, rounds: int, policies: dict) -> dict:
    saved = qmm.TC_ROWS
    caches, times = {}, {p: {L: [] for L in WIDTHS} for p in policies}
    builds = {p: {L: [] for L in WIDTHS} for p in policies}
    for p in policies:
        caches[p] = make_prompt_cache(model)
        mx.eval(model(mx.random.randint(0, vocab, (1, 512)), cache=caches[p]))
    toks = {L: mx.random.randint(0, vocab, (1, L)) for L in WIDTHS}
    mx.eval(toks)
    for r in range(rounds + 2):  # two warm-up rounds
        for p, rows in policies.items():
            qmm.TC_ROWS = rows
            for L in WIDTHS:
                with switched_off() if p == "off" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    logits = model(toks[L], cache=caches[p])
                    t1 = time.perf_counter()  # the graph is built (host work), nothing has run
                    mx.eval(logits)
                if r >= 2:
                    times[p][L].append((time.perf_counter() - t0) * 1e3)
                    builds[p][L].append((t1 - t0) * 1e3)
            for c in caches[p]:
                if getattr(c, "offset", 0) > 700 and c.is_trimmable():
                    c.trim(c.offset - 600)
    qmm.TC_ROWS = saved
    out = {}
    for p, d in times.items():
        med = {L: statistics.median(v) for L, v in d.items()}
        out[p] = {f"ms_{L}": round(m, 3) for L, m in med.items()}
        out[p].update({f"ratio_{L}": round(med[L] / med[1], 3) for L in WIDTHS[1:]})
        out[p].update({f"build_ms_{L}": round(statistics.median(v), 3) for L, v in builds[p].items()})
    return out


def time_decode(model, vocab: int, rounds: int, policies: dict, tokens: int) -> dict:
    """Pipelined plain decoding (mlx-lm's generate_step, greedy) under each policy, round-robin:
    tokens/s of the TOKENS after the first, per round."""
    saved = qmm.TC_ROWS
    prompt = mx.random.randint(0, vocab, (512,))
    rates, outs = {p: [] for p in policies}, {}
    for r in range(rounds + 1):  # a warm-up round
        for p, rows in policies.items():
            qmm.TC_ROWS = rows
            with switched_off() if p == "off" else contextlib.nullcontext():
                steps = generate_step(prompt, model, max_tokens=tokens + 1, prompt_cache=make_prompt_cache(model))
                outs[p] = [next(steps)[0]]
                t0 = time.perf_counter()
                outs[p] += [tok for tok, _ in steps]
            if r:
                rates[p].append(tokens / (time.perf_counter() - t0))
    qmm.TC_ROWS = saved
    ref = outs[next(iter(policies))]
    res = {}
    for p, v in rates.items():
        q = statistics.quantiles(v, n=4)
        same = next((i for i, (a, b) in enumerate(zip(ref, outs[p])) if a != b), None)
        res[p] = {"tok_s": round(statistics.median(v), 2), "tok_s_iqr": [round(q[0], 2), round(q[2], 2)],
                  "reps": [round(x, 2) for x in v], "first_token_unlike_first_policy": same}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-matmuls", action="store_true")
    ap.add_argument("--policies", default="mlx,small-m,tc", help=f"of {', '.join(POLICIES)}")
    ap.add_argument("--decode", type=int, default=0, help="also time pipelined decoding of N tokens")
    ap.add_argument("--skip-forwards", action="store_true")
    args = ap.parse_args()
    model = random_model(args.shape, bits=4)
    res = {"shape": args.shape, "device": mx.device_info().get("device_name"), "rounds": args.rounds,
           "small_m_rows": qmm.MAX_ROWS, "matmuls": {}}
    if not args.skip_matmuls:
        for key, layer in matrices(model).items():
            res["matmuls"][key] = {}
            for rows in ROWS:
                res["matmuls"][key][rows] = cell = time_matmuls(layer, rows, 5)
                print(args.shape, key, rows, json.dumps(cell), flush=True)
    policies = {name: POLICIES[name] for name in args.policies.split(",")}
    if not args.skip_forwards:
        res["forwards"] = time_forwards(model, vocab_size(args.shape), args.rounds, policies)
        for p, d in res["forwards"].items():
            print("forward", p, json.dumps(d), flush=True)
    if args.decode:
        res["decode"] = time_decode(model, vocab_size(args.shape), args.rounds, policies, args.decode)
        for p, d in res["decode"].items():
            print("decode", p, json.dumps(d), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
