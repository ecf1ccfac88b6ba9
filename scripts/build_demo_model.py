"""Train the small demo model shipped in mlxspec/assets/demo/ (no network needed).

A tiny qwen3-architecture model learns Python from the standard-library sources
of the local Python install, wrapped in ChatML turns so `mlxspec run` exercises
the chat-template path and answers with Python-looking code.

    python scripts/build_demo_model.py --minutes 8          # time-boxed (picks --steps)
    python scripts/build_demo_model.py --steps 700 --seed 0  # exact re-run

Training uses MLX (the CPU backend works). On Linux the mlx[cpu] wheel links a
reference BLAS that makes this ~10x slower; scripts/openblas_shim.c says how to
route MLX's matmuls to OpenBLAS with LD_PRELOAD (the model card records whether it was).
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import platform
import sys
import sysconfig
import textwrap
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import tiny  # noqa: E402  (tests/tiny.py: the toy-checkpoint builders)

DEFAULT_OUT = REPO / "mlxspec" / "assets" / "demo"
MODEL_SIZES = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SAMPLE_PROMPT = "Write a Python function that adds two numbers."

# ---------------------------------------------------------------------------
# Corpus: stdlib sources -> (user, assistant) chat turns


def corpus_files(max_bytes: int, max_file_bytes: int = 150_000) -> list[Path]:
    """Top-level stdlib modules in name order, up to MAX_BYTES (deterministic per Python version)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        size = path.stat().st_size
        if size > max_file_bytes or path.name.startswith("_"):
            continue
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def third_person(word: str) -> str:
    """'Return' -> 'returns', so a docstring reads as 'a function that returns ...'."""
    w = word.lower()
    if w.endswith("s"):
        return w
    if w.endswith(("sh", "ch", "x", "o")):
        return w + "es"
    if w.endswith("y") and len(w) > 1 and w[-2] not in "aeiou":
        return w[:-1] + "ies"
    return w + "s"


def function_request(node: ast.FunctionDef) -> str:
    """A user request for NODE: from its docstring when it has one, else by name."""
    doc = ast.get_docstring(node)
    first = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
    verb, _, rest = first.partition(" ")
    if verb.isalpha() and verb.lower() not in ("a", "an", "the", "this"):  # "Return x." etc.
        return f"Write a Python function that {third_person(verb)} {rest}".strip()
    return f"Write a Python function named {node.name}."


def file_examples(path: Path) -> list[tuple[str, str]]:
    """(user, assistant) pairs from one source file: its functions and its raw chunks."""
    source = path.read_text(encoding="utf-8", errors="replace")
    lines = source.splitlines()
    examples = []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = None
    if tree is not None:
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for i, node in enumerate(functions):
            if not 3 <= node.end_lineno - node.lineno + 1 <= 40:
                continue
            code = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
            if i % 3 == 2:  # every third: continue from the signature and first lines
                head, tail = code.split("\n", 2)[:2], code.split("\n", 2)[2:]
                if tail:
                    examples.append(("Continue this code:\n" + "\n".join(head), tail[0]))
                    continue
            examples.append((function_request(node), code))
    for start in range(0, len(lines), 40):
        chunk = "\n".join(lines[start:start + 40]).strip("\n")
        if chunk:
            examples.append(("Write Python code.", chunk))
    return examples


def render_chat(user: str, assistant: str) -> str:
    """One ChatML exchange, exactly as tiny.CHATML_TEMPLATE renders it (+ the answer)."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def token_stream(tokenizer_dir: Path, texts: list[str]) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encoded])


# ---------------------------------------------------------------------------
# Training


def build_model(vocab_size: int, eos_ids: list[int], pad_id: int):
    from mlxspec.compat import model_classes

    config = tiny.make_config("qwen3", vocab_size, eos_ids, pad_id, **MODEL_SIZES)
    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config)), config


def random_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> mx.array:
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return mx.array(np.stack([stream[s:s + seq + 1] for s in starts]))


def loss_fn(model, tokens: mx.array) -> mx.array:
    logits = model(tokens[:, :-1])
    return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()


def evaluate(model, stream: np.ndarray, batch: int, seq: int, n_batches: int = 8) -> float:
    rng = np.random.default_rng(1234)  # same windows every time
    losses = [loss_fn(model, random_windows(stream, rng, batch, seq)).item() for _ in range(n_batches)]
    return float(np.mean(losses))


def learning_rate(step: int, total: int, peak: float, warmup: int = 40) -> float:
    """Linear warmup, then cosine decay to 10% of PEAK."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(model, train_stream, args) -> tuple[int, float, float]:
    """Returns (steps run, final training loss (mean of last 20 steps), seconds)."""
    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(tokens):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, tokens)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(args.seed)
    total = args.steps
    losses, start, i = [], time.time(), 0
    while total is None or i < total:
        if total is None and i == 20:  # time-boxed: size the schedule from measured speed
            per_step = (time.time() - start) / 20
            total = max(40, int(args.minutes * 60 / per_step))
            print(f"{per_step:.2f} s/step -> {total} steps", flush=True)
        optimizer.learning_rate = learning_rate(i, total or 10**6, args.lr)
        loss = step(random_windows(train_stream, rng, args.batch, args.seq))
        mx.eval(loss, state)
        losses.append(loss.item())
        if i % 50 == 0:
            print(f"step {i} loss {losses[-1]:.3f} ({time.time() - start:.0f}s)", flush=True)
        i += 1
    return i, float(np.mean(losses[-20:])), time.time() - start


# ---------------------------------------------------------------------------
# Output


def greedy_sample(model_dir: Path, max_tokens: int = 120) -> str:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": SAMPLE_PROMPT}],
                                           add_generation_prompt=True)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)


def machine_description() -> str:
    preload = os.environ.get("LD_PRELOAD")
    blas = f", matmuls via LD_PRELOAD={Path(preload).name}" if preload else ""
    return f"{platform.machine()}, {platform.system()}, {os.cpu_count()} cores{blas}"


def write_model_card(out: Path, facts: dict) -> None:
    f = facts
    kv_heads, tokens_seen = f['num_key_value_heads'], f['steps'] * f['batch'] * f['seq']
    card = f"""# mlxspec-demo

A tiny demo model shipped with mlxspec so `mlxspec run` works offline on a fresh
machine. It is a toy: it writes Python-looking code, not correct programs.

- Architecture: Qwen3 (`model_type: qwen3`), hidden {f['hidden_size']}, {f['num_hidden_layers']} layers,
  {f['num_attention_heads']} query heads / {kv_heads} KV heads of {f['head_dim']}, MLP {f['intermediate_size']},
  tied embeddings; {f['params']:,} parameters, stored in bfloat16 ({f['weights_bytes'] / 1e6:.1f} MB).
- Tokenizer: byte-level BPE, {f['vocab_size']} tokens, trained on the same corpus
  (`train_tokenizer` in tests/tiny.py), ChatML template, EOS `<|im_end|>`.
- Corpus: {f['n_files']} top-level standard-library modules of Python {f['python']}
  (sorted by name, up to {f['max_bytes'] / 1e6:.1f} MB; every 10th file held out), wrapped in
  ChatML turns: "Write a Python function that <docstring>" / "... named <name>" /
  "Continue this code:" -> the function, and "Write Python code." -> 40-line chunks.
  {f['train_tokens']:,} training tokens, {f['heldout_tokens']:,} held-out tokens.
- Training: MLX {f['mlx']} on CPU ({f['machine']}), AdamW peak lr {f['lr']}, batch {f['batch']} x {f['seq']} tokens,
  {f['steps']} steps ({tokens_seen:,} tokens seen) in {f['train_seconds'] / 60:.1f} min, seed {f['seed']}.
- Final training loss (mean of last 20 steps): {f['train_loss']:.3f} nats/token.
  Held-out loss: {f['heldout_loss']:.3f} nats/token (the untrained model: {f['initial_heldout_loss']:.3f}).
- Trained on windows of {f['seq']} tokens: text much longer than that degrades.

Regenerate (same steps and seed; the BLAS can change the last bits):

    python scripts/build_demo_model.py --steps {f['steps']} --seed {f['seed']}

## Sample (greedy, chat template, bf16 weights)

Prompt: "{SAMPLE_PROMPT}"

```
{f['sample']}
```
"""
    (out / "MODEL_CARD.md").write_text(card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=8.0, help="training time box (ignored with --steps)")
    parser.add_argument("--steps", type=int, default=None, help="exact number of training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    mx.random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    files = corpus_files(args.max_bytes)
    held_out = set(files[9::10])
    texts = {True: [], False: []}
    for path in files:
        texts[path in held_out] += [render_chat(u, a) for u, a in file_examples(path)]
    tiny.train_tokenizer(texts[False], args.vocab, args.out)
    vocab_size, special = tiny.tokenizer_info(args.out)
    train_stream = token_stream(args.out, texts[False])
    heldout_stream = token_stream(args.out, texts[True])
    print(f"{len(files)} files, {len(train_stream):,} train / {len(heldout_stream):,} held-out tokens", flush=True)

    eos_ids = [special[tiny.EOS_TOKEN], special[tiny.PAD_TOKEN]]
    model, config = build_model(vocab_size, eos_ids, special[tiny.PAD_TOKEN])
    initial_heldout = evaluate(model, heldout_stream, args.batch, args.seq)
    steps, train_loss, seconds = train(model, train_stream, args)
    heldout_loss = evaluate(model, heldout_stream, args.batch, args.seq)
    print(f"train loss {train_loss:.3f}, held-out {heldout_loss:.3f} (from {initial_heldout:.3f})", flush=True)

    config["torch_dtype"] = "bfloat16"
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}  # mlx names == HF names
    tiny.save_safetensors(args.out / "model.safetensors", weights, "bfloat16")
    tiny.write_config_files(args.out, config, eos_ids, special[tiny.PAD_TOKEN])

    sample = greedy_sample(args.out)
    print(sample)
    write_model_card(args.out, {
        **MODEL_SIZES, "vocab_size": vocab_size, "params": sum(w.size for w in weights.values()),
        "weights_bytes": (args.out / "model.safetensors").stat().st_size,
        "n_files": len(files), "python": platform.python_version(), "max_bytes": args.max_bytes,
        "train_tokens": len(train_stream), "heldout_tokens": len(heldout_stream),
        "mlx": mx.__version__, "machine": machine_description(),
        "lr": args.lr, "batch": args.batch, "seq": args.seq, "steps": steps, "seed": args.seed,
        "train_seconds": seconds, "train_loss": train_loss, "heldout_loss": heldout_loss,
        "initial_heldout_loss": initial_heldout, "sample": sample,
    })


if __name__ == "__main__":
    main()
