"""``mlxspec bench MODEL --concurrency 1,2,4,8``: N requests at once, three ways.

Engines, at each concurrency N (N requests: the workload's prompts in order, repeated as
needed, each with its own max_tokens):
- ``mlxspec batched``: the N requests as rows of one batch (engine/batch.py), speculating;
- ``mlxspec serial``: the same N requests one after another with the single-request engine
  (what ``serve`` did before batching);
- ``mlx-lm batched``: mlx-lm's ``batch_generate`` over the N prompts, no speculation.
Repetitions run the engines in turn (ABC ABC ...); each repetition's aggregate tok/s (all
requests' tokens over the wall time of the N) gives paired ratios, reported as the median and
interquartile range. Per-request tok/s: a request's tokens over the time from the start to its
last token (what one client sees). ``identical``: every batched request's tokens equal the
serial engine's (temperature 0 only: at temperature > 0 they are compared as distributions by
the tests, not here).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import mlx.core as mx

from ..errors import UsageError
from .paired import paired_speedup

ENGINES = ("mlxspec batched", "mlxspec serial", "mlx-lm batched")
MAX_CONCURRENCY = 64


def parse_levels(text: str) -> list[int]:
    """``1,2,4,8`` -> [1, 2, 4, 8] (each from 1 to MAX_CONCURRENCY)."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(not 1 <= n <= MAX_CONCURRENCY for n in levels):
        raise UsageError(f"--concurrency must be a comma-separated list of numbers from 1 to {MAX_CONCURRENCY}, "
                         f"e.g. 1,2,4,8 (got {text!r})")
    return sorted(set(levels))


@dataclass
class Run:
    tokens: list[list[int]]  # per request
    seconds: float  # wall time of all N
    finished: list[float]  # per request: seconds from the start to its last token

    @property
    def aggregate(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds

    @property
    def per_request(self) -> float:
        return statistics.median(len(t) / s for t, s in zip(self.tokens, self.finished) if s > 0)


def run_batched(spec, requests: list[tuple[list[int], int]], drafter: str, temperature: float, seed: int) -> Run:
    batch = spec.batch(len(requests))
    t0 = time.perf_counter()
    streams = [spec.stream_in(batch, ids, drafter=drafter, max_tokens=n, temperature=temperature,
                              seed=None if temperature == 0 else seed + i, reuse=False)
               for i, (ids, n) in enumerate(requests)]
    tokens: list[list[int]] = [[] for _ in requests]
    finished = [0.0] * len(requests)
    live = list(range(len(requests)))
    while live:
        for i in list(live):
            try:
                tokens[i].extend(next(streams[i]).tokens)
            except StopIteration:
                finished[i] = time.perf_counter() - t0
                live.remove(i)
    return Run(tokens, time.perf_counter() - t0, finished)


def run_serial(spec, requests: list[tuple[list[int], int]], drafter: str, temperature: float, seed: int) -> Run:
    t0 = time.perf_counter()
    tokens, finished = [], []
    for i, (ids, n) in enumerate(requests):
        r = spec.generate(ids, drafter=drafter, max_tokens=n, temperature=temperature,
                          seed=None if temperature == 0 else seed + i, reuse=False)
        tokens.append(r.tokens)
        finished.append(time.perf_counter() - t0)
    return Run(tokens, time.perf_counter() - t0, finished)


def run_mlx_lm(spec, requests: list[tuple[list[int], int]], temperature: float, seed: int) -> Run:
    """mlx-lm's own batched generation (no speculation), its sampler at TEMPERATURE."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    t0 = time.perf_counter()
    out = batch_generate(spec.target.model, spec.tokenizer, [ids for ids, _ in requests],
                         max_tokens=[n for _, n in requests], sampler=make_sampler(temp=temperature),
                         return_token_ids=True)
    seconds = time.perf_counter() - t0
    tokens = [list(t) for t in out.token_ids]
    return Run(tokens, seconds, [seconds] * len(tokens))  # it returns all at the end


def join_gaps(spec, running: list[int], join_tokens: int, drafter: str, max_tokens: int = 10_000) -> dict:
    """A request decodes while a JOIN_TOKENS-token prompt joins the batch: the gaps between the
    running request's chunks (ms) before the join, while the new prompt prefills (a chunk a
    step), and the worst. The joining request is cancelled once its first token is out."""
    batch = spec.batch(2)
    stream = spec.stream_in(batch, running, drafter=drafter, max_tokens=max_tokens, reuse=False)
    gaps_before, gaps_during = [], []
    last = time.perf_counter()
    for _ in range(8):
        if next(stream, None) is None:
            raise UsageError("--join-tokens: the running request ended before the join (give a larger "
                             "--max-tokens or another workload)")
        now = time.perf_counter()
        gaps_before.append(now - last)
        last = now
    vocab = spec.target.vocab_size or 1000
    prompt = [(7 * i + 11) % vocab for i in range(join_tokens)]
    joining = spec.stream_in(batch, prompt, raw=True, drafter=drafter, max_tokens=2, reuse=False)
    while batch.joining:
        next(joining)  # one prefill chunk and the running row's decode step
        if next(stream, None) is None:
            break
        now = time.perf_counter()
        gaps_during.append(now - last)
        last = now
    joining.close()
    stream.close()
    return gap_summary(gaps_before[1:], gaps_during, join_tokens, batch.prefill_step)


def gap_summary(before: list[float], during: list[float], join_tokens: int, prefill_step: int) -> dict:
    """A running request's gaps between tokens (seconds) BEFORE and DURING a join, in ms:
    their medians, the worst during, and how many steps the join took."""
    ms = [1000 * g for g in during]
    return {"join_tokens": join_tokens, "prefill_step": prefill_step, "steps": len(ms),
            "gap_ms_before": round(1000 * statistics.median(before), 2),
            "gap_ms_during": round(statistics.median(ms), 2) if ms else None,
            "worst_gap_ms": round(max(ms), 2) if ms else None}


def measure(spec, prompts: list[tuple[list[int], int]], levels: list[int], *, drafter: str = "auto",
            reps: int = 3, temperature: float = 0.0, seed: int = 0, join_tokens: int | None = None,
            on_step=None) -> dict:
    """The JSON document of the concurrency benchmark (see the module's docstring)."""
    cells = []
    total = len(levels) * reps * len(ENGINES)
    done = 0
    for n in levels:
        requests = [prompts[i % len(prompts)] for i in range(n)]
        runs: dict[str, list[Run]] = {e: [] for e in ENGINES}
        for rep in range(reps):
            for engine in ENGINES:
                if on_step:
                    on_step(f"concurrency {n}: {engine}", done, total)
                if engine == "mlxspec batched":
                    run = run_batched(spec, requests, drafter, temperature, seed + 1000 * rep)
                elif engine == "mlxspec serial":
                    run = run_serial(spec, requests, drafter, temperature, seed + 1000 * rep)
                else:
                    run = run_mlx_lm(spec, requests, temperature, seed + 1000 * rep)
                runs[engine].append(run)
                done += 1
        identical = None
        if temperature == 0:
            identical = all(b.tokens == s.tokens for b, s in zip(runs["mlxspec batched"], runs["mlxspec serial"]))
        for engine in ENGINES:
            mine = runs[engine]
            cell = {"concurrency": n, "engine": engine, "reps": reps,
                    "aggregate_tps": round(statistics.median(r.aggregate for r in mine), 2),
                    "per_request_tps": round(statistics.median(r.per_request for r in mine), 2),
                    "tokens": sum(len(t) for t in mine[0].tokens)}
            for base in ("mlxspec serial", "mlx-lm batched"):
                if base != engine:
                    paired = paired_speedup([r.aggregate for r in mine], [b.aggregate for b in runs[base]])
                    key = "vs_serial" if base == "mlxspec serial" else "vs_mlx_lm_batched"
                    cell[key], cell[key + "_iqr"] = paired["speedup"], paired["speedup_iqr"]
            if engine == "mlxspec batched":
                cell["identical"] = identical
            cells.append(cell)
    doc = {"benchmark": "concurrency", "model": spec.name, "drafter": drafter, "temperature": temperature,
           "reps": reps, "levels": levels, "device": str(mx.default_device()), "cells": cells}
    if join_tokens:
        if on_step:
            on_step(f"a {join_tokens}-token prompt joins", total, total)
        doc["join"] = join_gaps(spec, prompts[0][0], join_tokens, drafter)
    return doc


def render(doc: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"{doc['model']}: requests at once (drafter {doc['drafter']}, "
                        f"temperature {doc['temperature']}, {doc['reps']} reps, medians)")
    for col in ("N", "engine", "aggregate tok/s", "per request tok/s", "vs serial", "vs mlx-lm batched",
                "identical"):
        table.add_column(col, justify="right" if col not in ("engine",) else "left")
    for c in doc["cells"]:
        def ratio(key):
            if c.get(key) is None:  # the engine itself, or a run too short to time
                return "-"
            return f"{c[key]:.2f}x [{c[key + '_iqr'][0]:.2f}-{c[key + '_iqr'][1]:.2f}]"
        identical = c.get("identical")
        table.add_row(str(c["concurrency"]), c["engine"], f"{c['aggregate_tps']:.1f}", f"{c['per_request_tps']:.1f}",
                      ratio("vs_serial"), ratio("vs_mlx_lm_batched"),
                      "-" if identical is None else "yes" if identical else "NO")
    console.print(table)
    j = doc.get("join")
    if j:
        console.print(f"a {j['join_tokens']}-token prompt joining ({j['steps']} prefill chunks of "
                      f"{j['prefill_step']}): the running request's gap between chunks {j['gap_ms_before']} ms before, "
                      f"median {j['gap_ms_during']} ms and worst {j['worst_gap_ms']} ms during")
