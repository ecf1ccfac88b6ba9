"""Cross-check mlxspec's GGUF import against llama.cpp (llama-cpp-python) on the same file.

Both greedy-decode the same prompt ids (the chat template rendered by the converted
tokenizer); prints the share of the first N tokens where both agree (each prompt counted up to
its first disagreement or stop, and position by position), the Pearson correlation of the
first step's logits, how far below llama.cpp's best logit our first pick lies (disagreements
should be near ties: kernel noise, not a wrong import), and whether both tokenizers split the
prompts alike.

    .venv/bin/python scripts/gguf_crosscheck.py ~/.cache/mlxspec-tests/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "Explain what a prime number is.", "How many legs does a spider have?", "Give me a synonym for happy.",
    "What is 12 times 12?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Write a Python function that reverses a string.", "Who wrote Romeo and Juliet?",
    "List two benefits of exercise.", "What does HTML stand for?", "Describe a cat in one sentence.",
    "What is the boiling point of water in Celsius?", "Suggest a name for a pet goldfish.",
    "What is photosynthesis?", "Summarize the plot of Cinderella in two sentences.",
    "What is the largest planet in our solar system?", "Tell me a fun fact about octopuses.",
]


def ours_greedy(model, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], np.ndarray]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
    first = np.array(logits)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        if token in eos:
            break
        logits = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
    return out, first


def llama_greedy(llm, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], np.ndarray]:
    llm.reset()
    llm.eval(ids)
    first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    out = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        if token in eos:
            break
        llm.eval([token])
    return out, first


def compare(gguf_path: str, prompts: list[str], n: int, float32: bool = True, loaded=None) -> dict:
    """The figures for PROMPTS, N greedy tokens each; LOADED: (model, tokenizer) of the GGUF
    already converted and loaded."""
    import mlx.core as mx
    from llama_cpp import Llama
    from mlx_lm import load

    from mlxspec.models.gguf import convert_gguf

    if loaded:
        model, tokenizer = loaded
    else:
        with tempfile.TemporaryDirectory() as tmp:
            convert_gguf(gguf_path, f"{tmp}/model")
            model, tokenizer = load(f"{tmp}/model")
    if float32:
        model.set_dtype(mx.float32)
    llm = Llama(model_path=str(gguf_path), n_ctx=1024, logits_all=True, verbose=False)
    eos = set(tokenizer.eos_token_ids)
    agree = total = prefix = 0
    correlations, same_tokens, first_token, gaps = [], 0, 0, []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        text = tokenizer.decode(ids)
        same_tokens += llm.tokenize(text.encode(), add_bos=False, special=True) == list(ids)
        a, fa = ours_greedy(model, list(ids), n, eos)
        b, fb = llama_greedy(llm, list(ids), n, eos)
        length = min(len(a), len(b))
        first_token += a[0] == b[0]
        gaps.append(float(fb.max() - fb[int(np.argmax(fa))]))  # llama.cpp's logit gap to our pick
        agree += sum(x == y for x, y in zip(a[:length], b[:length]))
        total += length
        first_diff = next((i for i in range(length) if a[i] != b[i]), length)
        prefix += first_diff / length if length else 1.0
        correlations.append(float(np.corrcoef(fa, fb)[0, 1]))
    return {"first_token_agreement": first_token / len(prompts), "first_step_max_gap": max(gaps),
            "token_agreement": agree / total, "prefix_agreement": prefix / len(prompts),
            "first_step_correlation_min": min(correlations),
            "first_step_correlation_mean": float(np.mean(correlations)),
            "same_tokenization": same_tokens / len(prompts), "prompts": len(prompts), "tokens": n}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    for key, value in compare(args.gguf, PROMPTS, args.tokens).items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
