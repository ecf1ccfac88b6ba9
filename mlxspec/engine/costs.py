"""Measure what a verify forward of n tokens costs on this machine, relative to one token.

The curve is not linear: MLX's small-batch quantized kernels cost about linearly in rows up to
7 on GPUs, while 8+ rows take a matrix-unit path that can be cheaper than 6 (one CUDA
measurement of a 4-bit 8B shape: 10.2 / 23.8 / 32.1 / 18.8 ms for 1 / 4 / 6 / 8 tokens). The
depth choice reads the measured curve, so it drafts 7 rather than 5 where 8 rows are cheaper.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .cache import ModelState
from .gates import CostModel

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # verify widths of depths 0-8, then sparser
CURVE_CONTEXT = 128  # tokens in the cache the curve is timed over (a stored curve's, if it does not say)


class Budget:
    """The seconds a measurement may still take (None: unbounded). A forward is started only
    when its estimated time fits, so the whole measurement ends near its budget on a fast GPU
    and a slow CPU alike."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.perf_counter() + seconds

    def fits(self, seconds: float) -> bool:
        return self.end is None or time.perf_counter() + seconds <= self.end

    def left(self) -> float | None:
        """Seconds still to spend (None: unbounded)."""
        return None if self.end is None else max(0.0, self.end - time.perf_counter())


# a bounded measurement spends at most this share of its budget on filling the cache
PREFILL_SHARE = 0.25
PREFILL_CHUNK = 8  # tokens a bounded prefill adds at a time


def prefill_within(state: ModelState, context: int, vocab: int, seconds: float | None) -> int:
    """Fill STATE with up to CONTEXT tokens (all of them when SECONDS is None), chunk by chunk
    while the next chunk, timed like the last, fits SECONDS; returns the length. On a slow CPU
    a 128-token context cost 20+ s of a 135M model's prefill before any timing."""
    tokens = [(7 * i) % vocab for i in range(context)]
    if seconds is None:
        state.prefill(tokens)
        return context
    share = Budget(seconds)
    done, last = 0, 0.0
    while done < context:
        chunk = tokens[done:done + PREFILL_CHUNK]
        if done and not share.fits(last):
            break
        t0 = time.perf_counter()
        state.prefill(chunk)
        last = time.perf_counter() - t0
        done += len(chunk)
    return done


def verify_times(
    model: nn.Module, widths=WIDTHS, context: int = 128, reps: int = 3, vocab: int = 256,
    warmup_each: bool = False, budget_s: float | None = None,
    on_progress: Callable[[int, int], None] | None = None, pad_to: int | None = None,
) -> dict[int, list[float]]:
    """Seconds of each of ``reps`` forwards of n tokens over a warm cache of about
    ``context`` tokens, per width n. Each forward keeps its first token, so every call meets a
    new key length as in generation (a backend that rebuilds work per attention shape pays
    for it here, as it would in use: MLX's CUDA SDPA did, 50-70 ms a call). One untimed
    1-token forward warms up first; ``warmup_each`` adds an untimed forward of every width
    before timing.

    The reps are taken in rounds, each round one forward of every width (in turn forwards and
    backwards), not all reps of one width and then the next: a busy host slows a stretch of
    seconds, and timed width by width that stretch bent the curve (one 8B run put verify(5) at
    1.62x a token, the next at 2.15x, and the gate drafted to the bent curve). Interleaved,
    every width sees the same stretches.

    ``budget_s`` bounds the whole measurement: the context is filled with what a quarter of it
    allows, and a forward runs only when its time (as last measured, or n one-token forwards
    before that) fits in what is left, so a slow machine measures fewer widths and reps (the
    widths left out are missing from the result; width 1 is always timed). ``on_progress(done,
    total)`` follows the forwards. ``pad_to``: the cache is then padded with placeholder
    positions to that length (``ModelState.pad``); nothing is timed ({}) where it cannot be."""
    budget = Budget(budget_s)
    state = ModelState(model)
    prefill_within(state, context, vocab, None if budget_s is None else budget_s * PREFILL_SHARE)
    if pad_to is not None and not state.pad(pad_to - state.length):
        return {}
    order = tuple(dict.fromkeys((1,) + tuple(widths)))
    total = 1 + len(order) * (reps + (1 if warmup_each else 0))
    done = 0

    def forward(n: int) -> float:
        nonlocal done
        tokens = mx.array([(3 * i + n) % vocab for i in range(n)], mx.uint32)
        t0 = time.perf_counter()
        mx.eval(state.forward(tokens))
        seconds = time.perf_counter() - t0
        state.rollback_to(state.length - n + 1)  # keep the first token: the cache grows
        state.commit()
        done += 1
        if on_progress:
            on_progress(min(done, total), total)
        return seconds

    one = forward(1)  # warms up
    times: dict[int, list[float]] = {n: [] for n in order}

    def estimate(n: int) -> float:  # as last timed, else as n one-token forwards
        return max(times[n]) if times[n] else one * n

    if warmup_each:  # an untimed forward of each width; one whose warm-up and timing do not fit is left out
        kept = []
        for n in order:
            if n == 1 or budget.fits(2 * estimate(n)):
                forward(n)
                kept.append(n)
        order = tuple(kept)
    for rep in range(reps):
        for n in (order if rep % 2 == 0 else order[::-1]):
            if (n != 1 or times[1]) and not budget.fits(estimate(n)):  # one width-1 time always
                continue
            times[n].append(forward(n))
    if on_progress and done < total:
        on_progress(total, total)
    return {n: t for n, t in times.items() if t}


PLAIN_STEPS = 8  # pipelined plain tokens a timing run reads
PLAIN_RUNS = 2  # timed runs (after an untimed one); the fastest counts
PLAIN_CONTEXT = 16  # tokens in the cache before it: host time is what pipelining hides
PLAIN_MAX_S = 1.0  # within a budget, the measurement is skipped (factor 1) where it would take longer


def plain_factor(model: nn.Module, one: float, vocab: int = 256, steps: int = PLAIN_STEPS,
                 runs: int = PLAIN_RUNS, pad_to: int | None = None, cap: float = 1.0) -> float:
    """What a plain token costs in mlx-lm's pipelined loop (the next 1-token forward queued
    before the current token is read) over ONE, a waited 1-token forward's seconds: the
    fastest of RUNS timed runs of STEPS tokens, after an untimed one, within [0.25, 1]. The
    gate weighs a verify against this, not against a waited forward: on an H100 (8B shape)
    stock decoding ran 8.1 ms a token where a waited forward took 11.2 ms; measured so on an
    H200, 0.84 (8B) and 0.92 (27B). ``pad_to``: over a cache padded to that length
    (``ModelState.pad``), the result within [0.25, CAP]."""
    state = ModelState(model)
    state.prefill([(5 * i) % vocab for i in range(PLAIN_CONTEXT)])
    if pad_to is not None:
        state.pad(pad_to - state.length)

    def run() -> float:
        pending = mx.argmax(state.forward(mx.array([1], mx.uint32), rollback=False)[-1:], axis=-1)
        mx.async_eval(pending)
        pending.item()  # the timed part starts with nothing queued
        pending = mx.argmax(state.forward(pending.astype(mx.uint32), rollback=False)[-1:], axis=-1)
        mx.async_eval(pending)
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = mx.argmax(state.forward(pending.astype(mx.uint32), rollback=False)[-1:], axis=-1)
            mx.async_eval(nxt)
            pending.item()
            pending = nxt
        pending.item()
        return (time.perf_counter() - t0) / (steps + 1)

    run()
    per_token = min(run() for _ in range(runs))
    return min(cap, max(0.25, per_token / one))


def call_times(run, reps: int, warmup: int = 0, after=None) -> list[float]:
    """Seconds of each of ``reps`` calls of ``run`` (which must wait for its result), after
    ``warmup`` untimed calls; ``after()``, untimed, follows every call (e.g. a cache rollback)."""
    samples = []
    for rep in range(reps + warmup):
        t0 = time.perf_counter()
        run()
        if rep >= warmup:
            samples.append(time.perf_counter() - t0)
        if after:
            after()
    return samples


def measure_verify_cost(
    model: nn.Module, widths=WIDTHS, context: int = CURVE_CONTEXT, reps: int = 5, vocab: int = 256,
    budget_s: float | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> CostModel:
    """Time forwards of each width over a warm cache of ``context`` tokens (a second or two
    on a large GPU model); widths in between are interpolated by :class:`CostModel`. On a GPU
    each width gets an untimed forward first: MLX's CUDA backend compiles kernels per new
    shape (the CPU backend has nothing to compile). The fastest rep counts: on small models,
    where host-side launch time dominates, timing noise is one-sided and the median of a few
    reps swung widths by 30-50%.

    With ``budget_s`` (see :func:`verify_times`) the widths a slow machine could not afford
    are extrapolated at the slope of the last two measured ones (the CPU pays about per row).

    The pipelined plain token's cost (:func:`plain_factor`) is measured too: always without a
    budget, within one where its (PLAIN_STEPS + 2) x (PLAIN_RUNS + 1) forwards fit in
    PLAIN_MAX_S (a slow machine keeps 1)."""
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    samples = verify_times(model, widths, context, reps, vocab, warmup_each=on_gpu,
                           budget_s=budget_s, on_progress=on_progress)
    times = {n: min(s) for n, s in samples.items()}
    base = times[1]
    curve = {n: t / base for n, t in times.items()}
    cost = CostModel(curve=curve, measured=True, context=context)
    if budget_s is None or (PLAIN_STEPS + 2) * (PLAIN_RUNS + 1) * base <= PLAIN_MAX_S:
        cost.plain = plain_factor(model, base, vocab)
    if set(curve) != {1, *widths}:  # cut short by the budget
        measured = sorted(curve)
        if len(measured) >= 2:
            lo, hi = measured[-2:]
            cost.slope = max((curve[hi] - curve[lo]) / (hi - lo), 0.0)
        else:
            cost.slope = CostModel.default().slope
        cost.partial = True
    return cost


TREE_WIDTHS = (8, 16, 32)  # draft nodes of the trees timed against chains of as many rows


def binary_tree(n: int) -> list[int]:
    """Parents (with the root's -1) of a balanced binary tree of n + 1 rows."""
    return [-1] + [(i - 1) // 2 for i in range(1, n + 1)]


def measure_tree_factor(model: nn.Module, widths=TREE_WIDTHS, context: int = 128, reps: int = 3,
                        vocab: int = 256) -> float | None:
    """A tree forward's cost over a chain verify of as many rows (median over WIDTHS of the
    fastest reps, interleaved): 1 where the tree only changes the mask and positions, more on
    a hybrid whose recurrence runs level by level. None where this model cannot verify trees."""
    from .tree_forward import TreeUnsupported, keep_path, tree_forward

    state = ModelState(model)
    state.prefill([(7 * i) % vocab for i in range(context)])

    def chain(n: int) -> float:
        tokens = mx.array([(3 * i + n) % vocab for i in range(n + 1)], mx.uint32)
        t0 = time.perf_counter()
        mx.eval(state.forward(tokens))
        seconds = time.perf_counter() - t0
        state.rollback_to(state.length - n)
        state.commit()
        return seconds

    def tree(n: int) -> float:
        start = state.length
        tokens = mx.array([(5 * i + n) % vocab for i in range(n + 1)], mx.uint32)
        t0 = time.perf_counter()
        mx.eval(tree_forward(state, tokens, binary_tree(n)))
        seconds = time.perf_counter() - t0
        keep_path(state, start, [0])
        state.commit()
        return seconds

    try:
        for n in widths:  # untimed: kernels are built per new shape
            chain(n), tree(n)
        best = {n: [float("inf"), float("inf")] for n in widths}
        for _ in range(reps):
            for n in widths:
                best[n][0] = min(best[n][0], chain(n))
                best[n][1] = min(best[n][1], tree(n))
    except TreeUnsupported:
        return None
    ratios = sorted(t / c for c, t in best.values())
    return ratios[len(ratios) // 2]
