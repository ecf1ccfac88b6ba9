"""Temperature-0 identity on the GPU: where do mlx-lm and mlxspec diverge, and how close were
the top-2 logits there? Same setting as bench_plain.py (random 4-bit weights, bf16).

    python benchmarks/diag_identity.py --shape qwen3-1.7b --vocab 32000
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny  # noqa: E402  (tests/tiny.py: the toy-checkpoint builders)
from benchmarks.bench_plain import random_model  # noqa: E402
from mlxspec.engine.speculate import SpeculativeDecoder  # noqa: E402


def first_diff(x, y):
    return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    tok_dir = Path(tempfile.mkdtemp())
    corpus = [p.read_text(errors="ignore") for p in sorted(Path(json.__file__).parents[1].glob("*.py"))]
    tiny.train_tokenizer(corpus, a.vocab, tok_dir)
    tokenizer = load_tokenizer(tok_dir)
    prompt = tokenizer.encode("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n" * 4)
    model = random_model(a.shape, len(tokenizer.get_vocab()), 4)
    def mlx_lm_greedy():
        toks, lps = [], []
        for (t, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=a.tokens), range(a.tokens)):
            toks.append(t)
            lps.append(lp)
        return toks, lps

    ref, lps = mlx_lm_greedy()
    ref2, lps2 = mlx_lm_greedy()
    gaps = [(mx.sort(lp)[-1] - mx.sort(lp)[-2]).item() for lp in lps]
    report = {"shape": a.shape, "median_top2_gap": sorted(gaps)[len(gaps) // 2],
              # is plain decoding itself repeatable on this backend?
              "mlx_lm_repeat_first_diff": first_diff(ref, ref2),
              "mlx_lm_repeat_first_nonbitwise_logits": next(
                  (i for i, (x, y) in enumerate(zip(lps, lps2)) if not mx.array_equal(x, y).item()), None)}
    for drafter in ("none", "pld"):
        for depth in (2, 4, 8):
            dec = SpeculativeDecoder(model, drafter=drafter, depth=depth, gates=False)
            got = [t for toks, _ in dec.generate(prompt, max_tokens=a.tokens) for t in toks]
            i = first_diff(ref, got)
            report[f"{drafter}_d{depth}"] = {"first_diff": i, "top2_gap_there": gaps[i] if i is not None else None}
            if drafter == "none":
                again = [t for toks, _ in dec.generate(prompt, max_tokens=a.tokens) for t in toks]
                report["none_repeat_first_diff"] = first_diff(got, again)
                break
    print(json.dumps(report))


if __name__ == "__main__":
    main()
