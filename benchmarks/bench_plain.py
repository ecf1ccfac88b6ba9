"""mlxspec vs mlx-lm in one process: decode tok/s of `--drafter none` (and prompt lookup)
against ``mlx_lm.stream_generate`` on random-weight models of real shapes.

Random weights are fine for cost: a forward costs the same whatever the values. Runs are
interleaved (mlx-lm, mlxspec, mlx-lm, ...) after a warm-up; the median of the repetitions is
reported. Also checks that temperature-0 tokens are identical between the engines.

    python benchmarks/bench_plain.py --shapes qwen3-1.7b,qwen3-8b --bits 4 --tokens 256 --reps 5 \
        --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny  # noqa: E402  (tests/tiny.py: the toy-checkpoint builders)
from mlxspec.api import SpecModel  # noqa: E402

# the random-weight models of real shapes live in the package (also used by `mlxspec bench --sweep`)
from mlxspec.bench.synthetic import random_model  # noqa: E402
from mlxspec.models.loader import LoadedModel  # noqa: E402


def decode_tps(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def run_mlx_lm(model, tokenizer, prompt, n):
    stamps, toks = [], []
    for r in stream_generate(model, tokenizer, prompt, max_tokens=n):
        stamps.append(time.perf_counter())
        toks.append(r.token)
    return decode_tps(stamps), toks


def run_mlxspec(spec: SpecModel, prompt, n, drafter):
    stamps, toks, stats = [], [], None
    for chunk in spec.stream(prompt, max_tokens=n, drafter=drafter):
        if chunk.tokens:
            stamps.extend([time.perf_counter()] * len(chunk.tokens))
            toks.extend(chunk.tokens)
        stats = chunk.stats
    return decode_tps(stamps), toks, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-1.7b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    print("mlx", mx.__version__, mx.default_device(), flush=True)
    tok_dir = Path(tempfile.mkdtemp())
    corpus = [p.read_text(errors="ignore") for p in sorted(Path(json.__file__).parents[1].glob("*.py"))]
    tiny.train_tokenizer(corpus, a.vocab, tok_dir)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(tok_dir)
    tokenizer.eos_token_ids = set()  # random weights: never stop early, time every token
    vocab = len(tokenizer.get_vocab())
    prompt = tokenizer.encode("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n" * 4)
    results = []
    for shape in a.shapes.split(","):
        model = random_model(shape, vocab, a.bits)
        spec = SpecModel(LoadedModel(model, tokenizer, {}, tok_dir, shape))
        # warm-up (kernels, allocator), then interleave
        run_mlx_lm(model, tokenizer, prompt, 32)
        run_mlxspec(spec, prompt, 32, "none")
        base, none, pld = [], [], []
        for _ in range(a.reps):
            tps, ref = run_mlx_lm(model, tokenizer, prompt, a.tokens)
            base.append(tps)
            tps, got, _ = run_mlxspec(spec, prompt, a.tokens, "none")
            none.append(tps)
            same_none = got == ref
            tps, got_pld, st = run_mlxspec(spec, prompt, a.tokens, "pld")
            pld.append(tps)
            same_pld = got_pld == ref
        row = {
            "shape": shape, "bits": a.bits, "tokens": a.tokens, "reps": a.reps,
            "mlx_lm_tps": statistics.median(base), "mlxspec_none_tps": statistics.median(none),
            "mlxspec_pld_tps": statistics.median(pld),
            "none_ratio": statistics.median(none) / statistics.median(base),
            "pld_ratio": statistics.median(pld) / statistics.median(base),
            "none_identical": same_none, "pld_identical": same_pld,
            "pld_stats": st.to_dict(), "all_mlx_lm": base, "all_none": none, "all_pld": pld,
        }
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("all_")}), flush=True)
        del model, spec
        mx.clear_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
