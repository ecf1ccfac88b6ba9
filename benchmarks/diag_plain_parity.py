"""Plain decoding, mlxspec against mlx-lm, in interleaved pairs: is `--drafter none` at parity?

The real-shapes benchmark runs each cell five times and a host-bound decode on the GPU machine
swings 10-20% from run to run, so a ratio of two 5-run medians cannot show a 2% difference.
Here the engines alternate run by run on one random-weight model of a real shape (scripted
logits, as in ``mlxspec bench --real-shapes``), and the ratio is taken within each pair.

Engines: ``mlx-lm`` (``generate_step`` on the model as mlxspec loads it: the same module
objects, kernels on), ``mlx-lm-stock`` (the same with mlxspec's CUDA kernels switched off:
what plain mlx-lm runs), ``none`` (``SpeculativeDecoder`` with no drafter), ``pld``
(prompt lookup with its gates: on a novel workload they keep it off).

    python benchmarks/diag_plain_parity.py qwen3.6-27b --pairs 12 --tokens 128 \
        --engines mlx-lm,mlx-lm-stock,none --out parity.json
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
from mlxspec.bench.script import ScriptedLogits, make_script  # noqa: E402
from mlxspec.bench.synthetic import random_model, vocab_size  # noqa: E402
from mlxspec.engine.sampling import SamplingParams  # noqa: E402
from mlxspec.engine.speculate import SpeculativeDecoder  # noqa: E402
from mlxspec.kernels.switch import switched_off  # noqa: E402


def run_mlx_lm(model, prompt, n) -> tuple[list[int], float]:
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    stamps, tokens = [], []
    for tok, _ in generate_step(mx.array(prompt, mx.uint32), model, sampler=make_sampler(temp=0.0),
                                max_tokens=n):
        tokens.append(int(tok))
        stamps.append(time.perf_counter())
    return tokens, stamps[-1] - stamps[0]


def run_mlxspec(model, prompt, n, drafter) -> tuple[list[int], float]:
    dec = SpeculativeDecoder(model, drafter=drafter)
    stamps, tokens = [], []
    for new, _ in dec.generate(prompt, sampling=SamplingParams(0.0), max_tokens=n):
        if new:
            tokens.extend(new)
            stamps.append(time.perf_counter())
    return tokens, stamps[-1] - stamps[0]


def run(engine, model, prompt, n):
    if engine == "mlx-lm":
        return run_mlx_lm(model, prompt, n)
    if engine == "mlx-lm-stock":
        with switched_off():
            return run_mlx_lm(model, prompt, n)
    return run_mlxspec(model, prompt, n, engine)


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"p25": round(q[0], 4), "median": round(q[1], 4), "p75": round(q[2], 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--workload", default="novel")
    ap.add_argument("--engines", default="mlx-lm,mlx-lm-stock,none")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    engines = args.engines.split(",")
    vocab = vocab_size(args.shape)
    t0 = time.perf_counter()
    model = random_model(args.shape, bits=args.bits)
    script = make_script(args.workload, vocab, args.prompt_tokens, args.tokens)
    ScriptedLogits(model, script.target)  # the model now emits the script
    print(f"built {args.shape} in {time.perf_counter() - t0:.1f}s", flush=True)
    for e in engines:  # warm-up: kernels and the allocator for each engine
        run(e, model, script.prompt, min(args.tokens, 32))
    ms = {e: [] for e in engines}
    identical = {e: True for e in engines}
    for i in range(args.pairs):
        order = engines if i % 2 == 0 else engines[::-1]  # alternate who goes first
        for e in order:
            mx.synchronize()
            mx.clear_cache()
            tokens, seconds = run(e, model, script.prompt, args.tokens)
            identical[e] &= tokens == script.continuation[: args.tokens]
            ms[e].append(1e3 * seconds / (len(tokens) - 1))
        print(f"pair {i + 1}: " + "  ".join(f"{e} {ms[e][-1]:.2f}" for e in engines), flush=True)
    base = engines[0]
    out = {"shape": args.shape, "workload": args.workload, "tokens": args.tokens, "pairs": args.pairs,
           "bits": args.bits, "mlx": mx.__version__, "device": str(mx.default_device()),
           "command": " ".join(sys.argv),
           "ms_per_token": {e: quartiles(v) for e, v in ms.items()},
           # speedup of each engine over the first, within each pair: (base ms) / (engine ms)
           "paired_speedup": {e: quartiles([b / x for b, x in zip(ms[base], ms[e])]) for e in engines},
           "identical": identical, "raw_ms": {e: [round(x, 3) for x in v] for e, v in ms.items()}}
    print(json.dumps({k: out[k] for k in ("ms_per_token", "paired_speedup", "identical")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
