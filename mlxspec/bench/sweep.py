"""``mlxspec bench --sweep``: what a forward of 1..N tokens costs over a warm cache, on random
weights in the shapes of real checkpoints (:mod:`mlxspec.bench.synthetic`).

This is the verify-cost curve speculation lives on: a verify of k drafts is a forward of k+1
tokens, and it pays when k+1 tokens cost little more than one.
"""

from __future__ import annotations

import statistics
import time

from ..errors import UsageError

DEFAULT_SHAPES = ("qwen3-1.7b", "qwen3-8b", "qwen3.5-9b-like", "qwen3.6-27b")


def parse_shapes(text: str, flag: str = "--sweep") -> list[str]:
    from .synthetic import SHAPES

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UsageError(f"{flag} needs at least one shape")
    for name in names:
        if name not in SHAPES:
            what = "sweep shape" if flag == "--sweep" else f"shape for {flag}"
            raise UsageError(f"unknown {what} '{name}'; choose from {', '.join(SHAPES)}")
    return names


def run_sweep(shapes, *, bits: int = 4, max_tokens: int = 16, context: int = 256, reps: int = 5,
              on_step=None, kernels_off: bool = False) -> dict:
    """For each shape: build the random model, time forwards of 1..max_tokens tokens (one
    untimed forward per width first, then ``reps`` timed), return ms per forward (median and
    every sample) and the ratio to one token. ``kernels_off`` adds, per shape, the same timing
    with mlxspec's CUDA kernels switched off, as an entry named 'SHAPE (kernels off)'."""
    import contextlib

    import mlx.core as mx

    from ..engine.cache import model_nbytes
    from ..engine.costs import verify_times
    from ..kernels import switched_off
    from .synthetic import random_model, shape_config, vocab_size

    if max_tokens < 1:
        raise UsageError(f"--sweep-tokens must be at least 1, got {max_tokens}")
    if context < 1:
        raise UsageError(f"--sweep-context must be at least 1, got {context}")
    if reps < 1:
        raise UsageError(f"--reps must be at least 1, got {reps}")
    results = []
    for i, shape in enumerate(shapes):
        if on_step:
            on_step(f"building {shape} ({bits}-bit)" if bits else f"building {shape}", i, len(shapes))
        t0 = time.perf_counter()
        model = random_model(shape, bits=bits)
        build_s = time.perf_counter() - t0
        config = shape_config(shape)
        for off in (True, False) if kernels_off else (False,):
            if on_step:
                on_step(f"timing {shape}" + (" (kernels off)" if off else ""), i, len(shapes))
            with switched_off() if off else contextlib.nullcontext():
                times = verify_times(model, widths=range(1, max_tokens + 1), context=context,
                                     reps=reps, vocab=vocab_size(shape), warmup_each=True)
            base = statistics.median(times[1])
            rows = [{"tokens": n, "ms": round(statistics.median(times[n]) * 1e3, 4),
                     "ratio": round(statistics.median(times[n]) / base, 4),
                     "samples_ms": [round(t * 1e3, 4) for t in times[n]]}
                    for n in range(1, max_tokens + 1)]
            results.append({"shape": shape + (" (kernels off)" if off else ""),
                            "model_type": config["model_type"],
                            "config": config.get("text_config", config), "bits": bits,
                            "weights_mb": round(model_nbytes(model) / 1e6, 1),
                            "build_s": round(build_s, 2), "context": context, "reps": reps,
                            "rows": rows})
        del model
        mx.clear_cache()
    if on_step:
        on_step("done", len(shapes), len(shapes))
    return {"shapes": results, "bits": bits, "max_tokens": max_tokens, "context": context, "reps": reps}


def sweep_table(sweep: dict):
    """Rich table: one row per token count, per shape ms per forward and the ratio to 1 token."""
    from rich.table import Table

    shapes = sweep["shapes"]
    bits = f"{sweep['bits']}-bit" if sweep.get("bits") else "bf16"
    table = Table(title="ms per forward (x the cost of one token)", title_justify="left",
                  caption=f"random {bits} weights, {sweep['context']} tokens in the cache, median of "
                          f"{sweep['reps']} forwards after a warm-up one", caption_justify="left")
    table.add_column("tokens", justify="right")
    for s in shapes:
        table.add_column(s["shape"], justify="right", no_wrap=True)
    for i in range(max((len(s["rows"]) for s in shapes), default=0)):
        cells = []
        for s in shapes:
            row = s["rows"][i] if i < len(s["rows"]) else None
            cells.append(f"{row['ms']:.2f} ({row['ratio']:.2f}x)" if row else "")
        table.add_row(str(i + 1), *cells)
    return table


def sweep_chart(sweep: dict, ax, device: str | None = None) -> None:
    """Ratio to one token against tokens per forward, one line per shape."""
    from matplotlib.ticker import MaxNLocator

    for s in sweep["shapes"]:
        ax.plot([r["tokens"] for r in s["rows"]], [r["ratio"] for r in s["rows"]], marker="o",
                markersize=3, label=s["shape"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tokens per forward (a verify of k drafts is k + 1)")
    ax.set_ylabel("cost / cost of 1 token")
    bits = f"{sweep['bits']}-bit" if sweep.get("bits") else "bf16"
    ax.set_title(f"forward cost over a {sweep['context']}-token cache, random {bits} weights"
                 + (f" ({device})" if device else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
