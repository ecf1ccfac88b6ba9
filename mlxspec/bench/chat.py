"""``mlxspec bench --chat``: time to first token on each turn of a growing chat, with and
without prefix reuse, and mlx-lm's for comparison: what reusing a conversation's cache saves.

The conversation is token ids, no tokenizer: user blocks of pseudo-random ids (fixed seed) and
the model's own greedy answers. Turn k's prompt is turn k-1's prompt + its answer + user block
k, and turn 1's block is sized so that the last turn's prompt is about ``context`` tokens.
Every turn runs three ways in one process: the engine with no prefix cache, the engine with
the conversation's :class:`PrefixCache` (fed by the earlier turns' reuse runs, as a chat
server's is), and ``mlx_lm.generate.generate_step`` (plain, nothing reused).
"""

from __future__ import annotations

import statistics
import time

from ..errors import UsageError

SEED = 0
LOW_ID = 10  # user-block ids are drawn from [LOW_ID, vocab): clear of special low ids
CACHE_BYTES = 8 << 30  # one conversation's entries; the engine keeps what fits, LRU first out


def first_block(turns: int, context: int, user_tokens: int, answer_tokens: int) -> int:
    """Tokens of turn 1's user block: the last turn's prompt is then ``context`` tokens."""
    return context - (turns - 1) * (user_tokens + answer_tokens)


def check_plan(turns: int, context: int, user_tokens: int, answer_tokens: int) -> None:
    if turns < 2:
        raise UsageError(f"--chat-turns must be at least 2 (turn 2 is the first that can reuse), got {turns}")
    if user_tokens < 1:
        raise UsageError(f"--chat-user-tokens must be at least 1, got {user_tokens}")
    if answer_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {answer_tokens}")
    if first_block(turns, context, user_tokens, answer_tokens) < 1:
        need = (turns - 1) * (user_tokens + answer_tokens) + 1
        raise UsageError(f"--chat-context {context} is too small for {turns} turns of {user_tokens} user + "
                         f"{answer_tokens} answer tokens: give at least {need}")


def default_user_tokens(turns: int, context: int, answer_tokens: int) -> int:
    """256, or fewer where the context is too short for that: turn 1 then keeps half of it."""
    if first_block(turns, context, 256, answer_tokens) >= context // 2:
        return 256
    return max(1, (context // 2) // max(turns - 1, 1) - answer_tokens)


def chat_config(*, turns: int, context: int, user_tokens: int, answer_tokens: int, reps: int,
                drafter: str, cache_bytes: int = CACHE_BYTES) -> dict:
    return {"turns": turns, "context": context, "user_tokens": user_tokens,
            "first_user_tokens": first_block(turns, context, user_tokens, answer_tokens),
            "answer_tokens": answer_tokens, "reps": reps, "drafter": drafter, "temperature": 0.0,
            "seed": SEED, "user_ids": [LOW_ID, "vocab"], "prefix_cache_bytes": cache_bytes}


def cast(model, dtype: str | None) -> None:
    """Cast the floating-point weights to DTYPE (quantized weights stay as they are)."""
    if dtype is None:
        return
    import mlx.core as mx
    from mlx.utils import tree_map

    to = getattr(mx, dtype)
    model.update(tree_map(lambda p: p.astype(to) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))


def user_blocks(turns: int, context: int, user_tokens: int, answer_tokens: int, vocab: int,
                seed: int = SEED) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = [first_block(turns, context, user_tokens, answer_tokens)] + [user_tokens] * (turns - 1)
    return [rng.integers(LOW_ID, vocab, size=n).tolist() for n in sizes]


def _fresh() -> None:
    import mlx.core as mx

    mx.synchronize()
    mx.clear_cache()


def _engine(model, prompt, answer_tokens, prefix_cache, decoder_kwargs) -> dict:
    """One engine run at temperature 0, timed from the caller's side: time to the first token,
    the tokens, and how many prompt tokens came from the cache."""
    from ..engine.speculate import SpeculativeDecoder

    _fresh()
    decoder = SpeculativeDecoder(model, **decoder_kwargs)
    tokens, ttft, stats = [], None, None
    t0 = time.perf_counter()
    for new, stats in decoder.generate(prompt, max_tokens=answer_tokens, prefix_cache=prefix_cache):
        if new and ttft is None:
            ttft = time.perf_counter() - t0
        tokens.extend(new)
    return {"ttft_s": ttft, "tokens": tokens, "cached_tokens": stats.cached_tokens}


def _mlx_lm(model, prompt, answer_tokens) -> dict:
    """mlx-lm's own loop (greedy), a fresh cache: its time to the first token and its tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream, wired_limit

    _fresh()
    tokens, ttft = [], None
    t0 = time.perf_counter()
    with wired_limit(model, [generation_stream]):
        for token, _ in generate_step(mx.array(prompt, mx.uint32), model, max_tokens=answer_tokens):
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens.append(int(token))
    return {"ttft_s": ttft, "tokens": tokens}


def run_chat(model, *, turns: int = 5, context: int = 4096, user_tokens: int = 256,
             answer_tokens: int = 64, reps: int = 3, drafter="pld", vocab: int, on_step=None,
             label: str = "chat", cache_bytes: int = CACHE_BYTES, draft_model=None,
             mtp_head=None) -> dict:
    """Time every turn of the conversation ``reps`` times (a fresh prefix cache each time) after
    an untimed warm-up; return the raw runs and, per turn, their medians."""
    from ..engine.prefix_cache import PrefixCache

    check_plan(turns, context, user_tokens, answer_tokens)
    if reps < 1:
        raise UsageError(f"--reps must be at least 1, got {reps}")
    blocks = user_blocks(turns, context, user_tokens, answer_tokens, vocab)
    kwargs = dict(drafter=drafter, draft_model=draft_model, mtp_head=mtp_head)
    total = reps * turns
    if on_step:
        on_step(f"{label}: warm-up", 0, total)
    # warm-up: turn 1 every way, then a reuse turn 2 (compiles the short-suffix shapes too)
    warm = PrefixCache(cache_bytes)
    _engine(model, blocks[0], answer_tokens, None, kwargs)
    _mlx_lm(model, blocks[0], answer_tokens)
    answer = _engine(model, blocks[0], answer_tokens, warm, kwargs)["tokens"]
    _engine(model, blocks[0] + answer + blocks[1], answer_tokens, warm, kwargs)
    del warm

    runs = []
    for rep in range(reps):
        cache, history = PrefixCache(cache_bytes), []
        for k in range(turns):
            if on_step:
                on_step(f"{label}: repetition {rep + 1}/{reps}, turn {k + 1}/{turns}", rep * turns + k, total)
            prompt = history + blocks[k]
            plain = _engine(model, prompt, answer_tokens, None, kwargs)
            reused = _engine(model, prompt, answer_tokens, cache, kwargs)
            base = _mlx_lm(model, prompt, answer_tokens)
            runs.append({"rep": rep, "turn": k + 1, "prompt_tokens": len(prompt),
                         "cached_tokens": reused["cached_tokens"],
                         "no_reuse_cached_tokens": plain["cached_tokens"],
                         "ttft_ms": {"no_reuse": _ms(plain["ttft_s"]), "reuse": _ms(reused["ttft_s"]),
                                     "mlx_lm": _ms(base["ttft_s"])},
                         "identical": reused["tokens"] == plain["tokens"],
                         "identical_mlx_lm": plain["tokens"] == base["tokens"],
                         "answer": reused["tokens"]})
            history = prompt + reused["tokens"]  # the chat goes on with what it was shown
        del cache
        _fresh()
    if on_step:
        on_step(f"{label}: done", total, total)
    return {"vocab": vocab, "turns": summarize(runs), "runs": runs}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def summarize(runs: list[dict]) -> list[dict]:
    """Per turn: medians over the repetitions; ratio = no-reuse TTFT / reuse TTFT (medians)."""
    out = []
    for turn in sorted({r["turn"] for r in runs}):
        rows = [r for r in runs if r["turn"] == turn]
        med = {key: round(statistics.median(r["ttft_ms"][key] for r in rows), 3)
               for key in ("no_reuse", "reuse", "mlx_lm")}
        out.append({"turn": turn, "prompt_tokens": rows[0]["prompt_tokens"],
                    "cached_tokens": statistics.median_low(r["cached_tokens"] for r in rows),
                    "ttft_ms": med,
                    "ratio": round(med["no_reuse"] / med["reuse"], 3) if med["reuse"] else None,
                    "ratio_mlx_lm": round(med["mlx_lm"] / med["reuse"], 3) if med["reuse"] else None,
                    "identical": all(r["identical"] for r in rows),
                    "identical_mlx_lm": all(r["identical_mlx_lm"] for r in rows),
                    "same_answers": all(r["answer"] == rows[0]["answer"] for r in rows)})
    return out


def run_chat_shapes(shapes, *, bits: int = 4, dtype: str | None = None, on_step=None, **kwargs) -> list[dict]:
    """:func:`run_chat` on a random-weight model of each shape, one at a time, each freed
    before the next is built."""
    import mlx.core as mx

    from ..engine.cache import model_nbytes
    from .synthetic import random_model, shape_config, vocab_size

    results = []
    for shape in shapes:
        if on_step:
            on_step(f"{shape}: building ({bits}-bit)" if bits else f"{shape}: building (bf16)", 0, 1)
        t0 = time.perf_counter()
        model = random_model(shape, bits=bits)
        cast(model, dtype)
        build_s = time.perf_counter() - t0
        config = shape_config(shape)
        result = run_chat(model, vocab=vocab_size(shape), on_step=on_step, label=shape, **kwargs)
        results.append({"name": shape, "model_type": config["model_type"], "bits": bits,
                        "random_weights": True, "dtype": dtype, "weights_mb": round(model_nbytes(model) / 1e6, 1),
                        "build_s": round(build_s, 2), **result})
        del model
        mx.clear_cache()
    return results


def chat_chart(chat: dict, ax, device: str | None = None) -> None:
    """TTFT per turn: no reuse, reuse and mlx-lm, one line each per model."""
    from matplotlib.ticker import MaxNLocator

    styles = {"no_reuse": ("no reuse", "--"), "reuse": ("reuse", "-"), "mlx_lm": ("mlx-lm", ":")}
    for i, m in enumerate(chat["models"]):
        xs = [t["turn"] for t in m["turns"]]
        for key, (what, style) in styles.items():
            ax.plot(xs, [t["ttft_ms"][key] for t in m["turns"]], style, marker="o", markersize=3,
                    color=f"C{i % 10}", label=f"{m['name']}: {what}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms)")
    c = chat["config"]
    ax.set_title(f"growing chat to {c['context']} tokens, {c['answer_tokens']}-token answers"
                 + (f" ({device})" if device else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
