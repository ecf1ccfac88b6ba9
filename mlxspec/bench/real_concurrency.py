"""``mlxspec bench --real-shapes SHAPE --concurrency 1,2,4``: requests at once on a scripted
random-weight model of a real shape (bf16 activations, quantized weights, caches growing as in
generation), against STOCK mlx-lm's continuous batching in a process of its own.

Every request follows its own script through one successor table
(:func:`.script.make_follow_scripts`, ``ScriptedLogits.follow``): a row's logits are a one-hot
on the successor of its input token, so the rows of any batch, in any order, in mlxspec or in
mlx-lm, produce their scripts, and every output is checked against its script.

Engines at each concurrency N (the workload's first N scripts, each to ``max_tokens``):
- ``mlx-lm batched (stock)``: mlx-lm's ``BatchGenerator`` (no speculation) in the stock process
  (:mod:`.stock_worker`, its evidence checked before the first run and after the last);
- ``mlxspec batched``: the N requests as rows of one ``BatchedDecoder``, speculating (echo /
  novel: prompt lookup; the profiles and scripted-aA: the model's MTP head, steered per row);
- ``mlxspec batched, no drafter``: batching alone;
- ``mlxspec serial``: the single-request engine with the same drafter, one request after
  another (speculation alone: what ``serve`` did before batching).
Repetitions run the engines in that order (ABCD ABCD ...), so each run has its own stock run
beside it; ratios are per repetition (paired), reported as median and IQR.

Per run: ``aggregate_tps``, all tokens over the wall time of the N (prefill included: what N
clients see together); ``decode_tps``, the tokens after the moment every request has its first
token over the time from then to the last (the serial engine: its requests' decode times
summed); ``per_request_tps``, the median over requests of (tokens - 1) / (last - first token);
for the serial engine ``batching_bound`` (:attr:`Run.batching_bound`), the most a batch of its
requests can gain over it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from ..errors import UsageError
from .concurrency import gap_summary
from .paired import paired_speedup, quartiles
from .real_plan import BASELINE

STOCK_BATCHED = "mlx-lm batched (stock)"
BATCHED = "mlxspec batched"
BATCHED_PLAIN = "mlxspec batched, no drafter"
SERIAL = "mlxspec serial"
ENGINES = (STOCK_BATCHED, BATCHED, BATCHED_PLAIN, SERIAL)
LOOKUP_WORKLOADS = ("echo", "novel")  # drafted by prompt lookup; the rest by the steered MTP head


@dataclass
class Run:
    """One engine's N requests: per request its tokens and the seconds from the start to its
    first and last token; SERIAL: whether they ran one after another; STATS: mlxspec's counts."""

    tokens: list[list[int]]
    first: list[float]
    last: list[float]
    serial: bool = False
    stats: dict = field(default_factory=dict)

    @property
    def aggregate_tps(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.last)

    @property
    def decode_tps(self) -> float | None:
        if self.serial:
            span = sum(b - a for a, b in zip(self.first, self.last))
            return sum(len(t) - 1 for t in self.tokens) / span if span > 0 else None
        start = max(self.first)
        end = max(self.last)
        # tokens out by START: each request's share of its span, at its own pace
        before = sum(1 + (len(t) - 1) * min(1.0, (start - a) / (b - a)) if b > a else len(t)
                     for t, a, b in zip(self.tokens, self.first, self.last))
        return (sum(len(t) for t in self.tokens) - before) / (end - start) if end > start else None

    @property
    def batching_bound(self) -> float | None:
        """A serial run's wall time over its prompts' prefills (each request's time to its first
        token) plus its slowest request's decode: how much faster a batch of the same requests
        can be at most while a batch step costs at least one request's step and each prompt's
        prefill what it costs alone (the batch still waits for its slowest row)."""
        if not self.serial:
            return None
        starts = [0.0, *self.last[:-1]]
        prefills = sum(f - s for f, s in zip(self.first, starts))
        slowest = max(b - a for a, b in zip(self.first, self.last))
        return max(self.last) / (prefills + slowest)

    @property
    def per_request_tps(self) -> float | None:
        rates = [(len(t) - 1) / (b - a) for t, a, b in zip(self.tokens, self.first, self.last) if b > a]
        return statistics.median(rates) if rates else None


class ConcurrencyBench:
    """One shape's target (scripted to follow), its MTP head, the stock process and the scripts
    of each workload; :meth:`run` runs one engine at one concurrency."""

    def __init__(self, shape: str, *, bits: int, prompt_tokens: int, max_tokens: int, workloads, requests: int,
                 seed: int = 0, reps: int = 5, on_step=None, stock: bool = True):
        from ..engine.cache import model_nbytes
        from .real_shapes import forward_ms, mtp_step_ms, run_costs
        from .script import ScriptedLogits, make_follow_scripts, parse_workload
        from .stock import StockBaseline, build_beside
        from .synthetic import random_model, random_mtp_head, shape_config, vocab_size

        say = on_step or (lambda *a: None)
        for w in workloads:
            parse_workload(w)
        if shape_config(shape)["model_type"].startswith("gemma"):
            raise UsageError("--concurrency with --real-shapes: Gemma targets are served alone (sliding window)")
        self.shape, self.max_tokens = shape, max_tokens
        vocab = vocab_size(shape)
        self.tables, self.scripts = {}, {}
        for w in workloads:
            self.tables[w], self.scripts[w] = make_follow_scripts(w, vocab, requests, prompt_tokens, max_tokens, seed)
        say(f"{shape}: building the target ({bits}-bit)")
        self.stock = StockBaseline(shape, bits=bits, vocab=vocab, wait=False) if stock else None

        def build():
            self.model = random_model(shape, bits=bits)
            needs_head = any(w not in LOOKUP_WORKLOADS for w in workloads)
            self.head = random_mtp_head(self.model, shape, bits=bits) if needs_head else None

        build_beside(self.stock, build, say, shape)
        self.stock_evidence = self.stock.evidence if self.stock is not None else None
        self.target_nbytes = model_nbytes(self.model)
        self.logits = ScriptedLogits(self.model, [0])
        self.cost = run_costs(self.model, vocab, prompt_tokens + max_tokens, lambda what: say(f"{shape}: {what}"))
        self.forward1 = forward_ms(self.model, (), prompt_tokens, reps, vocab)[1]
        self.mtp_cost = mtp_step_ms(self.head, prompt_tokens, reps) / self.forward1 if self.head else 0.0
        self._following = None

    def close(self) -> None:
        """Stop the stock process (its evidence checked once more first: ``stock_evidence``)."""
        if self.stock is not None:
            stock, self.stock = self.stock, None
            self.stock_evidence = stock.finish()

    def follow(self, workload: str) -> None:
        import mlx.core as mx

        from ..engine.compiled_forward import CompiledForward

        if self._following != workload:
            self.logits.follow = mx.array(self.tables[workload], mx.int32)
            CompiledForward.of(self.model).scope = workload  # a graph holds the table it was traced with
            if self.stock is not None:
                self.stock.follow(self.tables[workload])
            self._following = workload

    def decoder(self, workload: str, script, drafter: bool):
        from ..engine.drafters.pld import PromptLookupDrafter
        from ..engine.speculate import SpeculativeDecoder
        from .script import SteeredMTP

        if not drafter:
            d = "none"
        elif workload in LOOKUP_WORKLOADS:
            d = PromptLookupDrafter()
        else:
            d = SteeredMTP(self.head, self.target_nbytes, script, cost_per_token=self.mtp_cost)
        return SpeculativeDecoder(self.model, drafter=d, cost=self.cost)

    def run(self, engine: str, workload: str, n: int) -> Run:
        import mlx.core as mx

        self.follow(workload)
        scripts = self.scripts[workload][:n]
        if engine == STOCK_BATCHED:
            if self.stock is None:
                raise UsageError(f"{engine} needs the stock mlx-lm process")
            out = self.stock.batch([s.prompt for s in scripts], self.max_tokens)
            return Run(out["tokens"], out["first_s"], out["last_s"])
        mx.synchronize()
        mx.clear_cache()
        if engine not in (SERIAL, BATCHED, BATCHED_PLAIN):
            raise UsageError(f"unknown engine {engine!r} ({', '.join(ENGINES)})")
        from ..engine.compiled_forward import traces

        traced = traces()[0]
        run = self._serial(workload, scripts) if engine == SERIAL else self._batched(workload, scripts,
                                                                                      engine == BATCHED)
        run.stats["compiled_traces"] = traces()[0] - traced  # graphs traced inside this timed run
        return run

    def _serial(self, workload: str, scripts) -> Run:
        from ..engine.sampling import SamplingParams

        tokens, first, last, counts = [], [], [], Counts()
        t0 = time.perf_counter()
        for s in scripts:
            dec = self.decoder(workload, s, True)
            mine, stats = [], None
            for new, stats in dec.generate(s.prompt, sampling=SamplingParams(0.0), max_tokens=self.max_tokens):
                if new:
                    if not mine:
                        first.append(time.perf_counter() - t0)
                    mine.extend(new)
            last.append(time.perf_counter() - t0)
            tokens.append(mine)
            counts.add(stats.to_dict())
        return Run(tokens, first, last, serial=True, stats=counts.summary(len(scripts)))

    def add_rows(self, batch, workload: str, scripts, drafter: bool, max_tokens: int) -> list:
        """SCRIPTS' prompts as greedy rows of BATCH with no stop token, each with its own drafter
        (none unless DRAFTER); their update streams."""
        from ..engine.batch import RowPlan
        from ..engine.sampling import SamplingParams

        return [batch.add(s.prompt, sampling=SamplingParams(0.0), max_tokens=max_tokens, stop_tokens=set(),
                          plan=RowPlan.of(self.decoder(workload, s, drafter))).updates() for s in scripts]

    def _batched(self, workload: str, scripts, drafter: bool, together: bool = True) -> Run:
        """SCRIPTS as rows of one batch; TOGETHER false: the rows draft one by one
        (benchmarks/diag_batch_drafting.py times the difference)."""
        from ..engine.batch import BatchedDecoder

        batch = BatchedDecoder(self.model, len(scripts), draft_together=together)
        t0 = time.perf_counter()
        updates = self.add_rows(batch, workload, scripts, drafter, self.max_tokens)
        tokens = [[] for _ in scripts]
        first, last = [0.0] * len(scripts), [0.0] * len(scripts)
        counts, final = Counts(), [None] * len(scripts)
        live = list(range(len(scripts)))
        while live:
            for i in list(live):
                try:
                    new, final[i] = next(updates[i])
                except StopIteration:
                    live.remove(i)
                    counts.add(final[i].to_dict())
                    continue
                if new:
                    now = time.perf_counter() - t0
                    if not tokens[i]:
                        first[i] = now
                    tokens[i].extend(new)
                    last[i] = now
        return Run(tokens, first, last, stats=counts.summary(len(scripts), batch.steps, batch.row_steps))


class Counts:
    """mlxspec's per-request counts summed over a run's requests."""

    def __init__(self):
        self.drafted = self.accepted = self.steps = 0

    def add(self, stats: dict) -> None:
        self.drafted += stats["drafted"]
        self.accepted += stats["accepted"]
        self.steps += stats["verify_steps"] + stats["plain_steps"]

    def summary(self, requests: int, batch_steps: int | None = None, row_steps: int | None = None) -> dict:
        out = {"drafted": self.drafted, "accepted": self.accepted, "row_steps": self.steps}
        if batch_steps:
            out.update(batch_steps=batch_steps, mean_rows=round(row_steps / batch_steps, 2))
        return out


def summarize(bench: ConcurrencyBench, runs: dict) -> list[dict]:
    """One JSON cell per (workload, N, engine): medians, paired ratios against the stock batched
    run and the serial run of the same repetition, and whether every request equals its script."""
    cells = []
    for (w, n, engine), mine in runs.items():
        want = [s.continuation[: bench.max_tokens] for s in bench.scripts[w][:n]]
        cell = {"shape": bench.shape, "workload": w, "concurrency": n, "engine": engine, "reps": len(mine),
                "context_tokens": len(bench.scripts[w][0].prompt), "max_tokens": bench.max_tokens,
                "identical": all(r.tokens == want for r in mine)}
        for key in ("aggregate_tps", "decode_tps", "per_request_tps"):
            values = [getattr(r, key) for r in mine]
            cell[key] = round(statistics.median(values), 2) if None not in values else None
        for base, tag in ((STOCK_BATCHED, "vs_stock_batched"), (SERIAL, "vs_serial")):
            theirs = runs.get((w, n, base), [])[: len(mine)]
            if base == engine or len(theirs) != len(mine):
                continue
            for key, suffix in (("aggregate_tps", ""), ("decode_tps", "_decode")):
                a, b = [getattr(r, key) for r in mine], [getattr(r, key) for r in theirs]
                if None in a or None in b:
                    continue
                paired = paired_speedup(a, b)
                cell[tag + suffix], cell[tag + suffix + "_iqr"] = paired["speedup"], paired["speedup_iqr"]
        if mine[0].stats:
            drafted = sum(r.stats["drafted"] for r in mine)
            cell["acceptance"] = round(sum(r.stats["accepted"] for r in mine) / drafted, 3) if drafted else None
            steps = sum(r.stats["row_steps"] for r in mine)
            cell["tokens_per_row_step"] = round(sum(len(t) for r in mine for t in r.tokens) / steps, 3)
            if "mean_rows" in mine[0].stats:
                cell["mean_rows"] = round(statistics.median(r.stats["mean_rows"] for r in mine), 2)
            cell["compiled_traces"] = sum(r.stats["compiled_traces"] for r in mine)
        if engine == SERIAL:
            cell["batching_bound"] = round(statistics.median(r.batching_bound for r in mine), 3)
        cell["reps_aggregate_tps"] = [round(r.aggregate_tps, 2) for r in mine]
        q = quartiles([r.aggregate_tps for r in mine])
        cell["aggregate_tps_iqr"] = [round(q[0], 2), round(q[2], 2)]
        cells.append(cell)
    return cells


def join_gaps(bench: ConcurrencyBench, workload: str, running: int, join_tokens: int) -> dict:
    """RUNNING requests of WORKLOAD decode while a JOIN_TOKENS-token prompt joins their batch:
    the first running request's gaps between tokens (ms) before the join, while the prompt
    prefills (a chunk of ``BatchedDecoder.prefill_step`` a step), and the worst."""
    from ..engine.batch import BatchedDecoder, RowPlan
    from ..engine.sampling import SamplingParams

    bench.follow(workload)
    batch = BatchedDecoder(bench.model, running + 1)
    streams = bench.add_rows(batch, workload, bench.scripts[workload][:running], True, 1 << 20)

    def tick() -> float:  # every running stream's next chunk; the first one's time
        for i, st in enumerate(streams):
            new, _ = next(st)
            while not new:
                new, _ = next(st)
            if i == 0:
                stamp = time.perf_counter()
        return stamp

    last = tick()
    before = []
    for _ in range(8):
        now = tick()
        before.append(now - last)
        last = now
    prompt = [(7 * i + 11) % len(bench.tables[workload]) for i in range(join_tokens)]
    joining = batch.add(prompt, sampling=SamplingParams(0.0), max_tokens=2, stop_tokens=set(),
                        plan=RowPlan(None, 1, gates=False))
    during = []
    while joining in batch.joining:
        now = tick()
        during.append(now - last)
        last = now
    batch.remove(joining)
    for st in streams:
        st.close()
    return {"workload": workload, "running": running, **gap_summary(before, during, join_tokens, batch.prefill_step)}


def run_real_concurrency(shape: str, *, levels, workloads, bits: int = 4, prompt_tokens: int = 512,
                         max_tokens: int = 128, reps: int = 8, seed: int = 0, join_tokens: int | None = None,
                         on_step=None, on_partial=None, stock: bool = True) -> dict:
    """The whole benchmark for one shape (see the module's docstring): warm-up runs of every
    (workload, N, engine), then ``reps`` repetitions; the JSON-ready result."""
    import mlx.core as mx

    engines = ENGINES if stock else ENGINES[1:]
    steps = {"done": 0, "total": (reps + 1) * len(workloads) * len(levels) * len(engines)}

    def say(message, advance=False):  # on_step(message, done, total), as bench's progress takes it
        steps["done"] += advance
        if on_step is not None:
            on_step(message, min(steps["done"], steps["total"]), steps["total"])

    if reps < 1 or prompt_tokens < 8 or max_tokens < 2:
        raise UsageError("--reps must be >= 1, --prompt-tokens >= 8 and --max-tokens >= 2")
    config = {"shape": shape, "bits": bits, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
              "reps": reps, "levels": list(levels), "workloads": list(workloads), "seed": seed,
              "order": " ".join(ENGINES), "temperature": 0.0}
    bench = ConcurrencyBench(shape, bits=bits, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                             workloads=workloads, requests=max(levels), seed=seed, on_step=say, stock=stock)

    def result(runs, join=None):
        from .report import compiled_graphs

        return {"benchmark": "concurrency", "baseline": BASELINE, "config": config,
                "stock_evidence": bench.stock_evidence, "device": str(mx.default_device()),
                "compiled_graphs": compiled_graphs(),
                "cells": summarize(bench, runs), "join": join}

    try:
        runs: dict = {}
        # repetition 0 warms up, unrecorded: MLX's CUDA backend builds kernels per new shape
        for rep in range(reps + 1):
            label = f"rep {rep}/{reps}" if rep else "warm-up"
            for w in workloads:
                for n in levels:
                    for engine in engines:
                        say(f"{label} {w} N={n} {engine}")
                        run = bench.run(engine, w, n)
                        if rep:
                            runs.setdefault((w, n, engine), []).append(run)
                        say(f"{label} {w} N={n} {engine}", True)
            if rep and on_partial is not None:
                on_partial(result(runs))
        join = None
        if join_tokens:
            say(f"a {join_tokens}-token prompt joins {max(levels) - 1} running requests")
            join = join_gaps(bench, workloads[0], max(max(levels) - 1, 1), join_tokens)
    finally:
        bench.close()
    return result(runs, join)


def render(result: dict, console) -> None:
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=f"{cfg['shape']} ({cfg['bits']}-bit, scripted): requests at once, {cfg['prompt_tokens']}-token "
                        f"prompts, {cfg['max_tokens']} tokens each, {cfg['reps']} reps, medians [IQR]")
    for col in ("workload", "N", "engine", "aggregate tok/s", "decode tok/s", "per request", "vs stock batched",
                "vs serial", "accept", "identical"):
        table.add_column(col, justify="left" if col in ("workload", "engine") else "right")

    def ratio(c, key):
        if c.get(key) is None:
            return "-"
        return f"{c[key]:.2f}x [{c[key + '_iqr'][0]:.2f}-{c[key + '_iqr'][1]:.2f}]"

    def num(v):
        return "-" if v is None else f"{v:.1f}"

    for c in result["cells"]:
        table.add_row(c["workload"], str(c["concurrency"]), c["engine"], num(c["aggregate_tps"]), num(c["decode_tps"]),
                      num(c["per_request_tps"]), ratio(c, "vs_stock_batched"), ratio(c, "vs_serial"),
                      "-" if c.get("acceptance") is None else f"{c['acceptance']:.2f}",
                      "yes" if c["identical"] else "NO")
    console.print(table)
    for c in result["cells"]:
        if c.get("batching_bound") and c["concurrency"] > 1:
            console.print(f"{c['workload']} at {c['concurrency']}: a batch can be at most {c['batching_bound']:.2f}x "
                          "the serial engine (its prefills plus its slowest request's decode)")
    j = result.get("join")
    if j:
        console.print(f"a {j['join_tokens']}-token prompt joining {j['running']} running {j['workload']} requests "
                      f"({j['steps']} steps, prefill chunks of {j['prefill_step']}): the first one's gap between "
                      f"tokens {j['gap_ms_before']} ms before, median {j['gap_ms_during']} ms and worst "
                      f"{j['worst_gap_ms']} ms during")
