"""Paired, interleaved measurement: the baseline run right before each measured run (ABAB), and
statistics of the per-repetition ratios.

Plain decoding on a shared GPU host swings by tens of percent between consecutive runs of the
same work, and drifts over minutes. A ratio of medians taken far apart carries all of that; the
ratio of each run to the baseline run just before it (same workload, same settings) cancels the
slow part, and the median and interquartile range of those ratios say how far the rest reaches.
Pure Python: no mlx.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def abab(cells: Sequence[T], baseline_of: Callable[[T], T]) -> list[tuple[T, T | None]]:
    """One repetition's order as (baseline, cell) pairs, run in sequence: each cell that is not a
    baseline right after a run of its own baseline (B A B A' ...); a baseline that no cell pairs
    with still runs once, alone, as (baseline, None)."""
    paired = {baseline_of(c) for c in cells if baseline_of(c) != c}
    out = []
    for c in cells:
        base = baseline_of(c)
        if base != c:
            out.append((base, c))
        elif c not in paired:
            out.append((c, None))
    return out


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(q1, median, q3), inclusive method (the data's own range); one value: itself three times."""
    if not values:
        raise ValueError("no values")
    if len(values) == 1:
        return (values[0],) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def paired_ratios(ours: Sequence[float | None], base: Sequence[float | None]) -> list[float] | None:
    """ours[i] / base[i] for each repetition (None if any rate is missing or zero: a run too short
    to time)."""
    if len(ours) != len(base) or not ours:
        raise ValueError(f"{len(ours)} measured runs against {len(base)} baseline runs")
    if any(not x for x in list(ours) + list(base)):
        return None
    return [o / b for o, b in zip(ours, base)]


def paired_speedup(ours: Sequence[float | None], base: Sequence[float | None], digits: int = 3) -> dict:
    """``speedup``: the median of the paired ratios; ``speedup_iqr``: their [q1, q3]; ``ratios``:
    each repetition's. All None when a run could not be timed."""
    ratios = paired_ratios(ours, base)
    if ratios is None:
        return {"speedup": None, "speedup_iqr": None, "ratios": None}
    q1, median, q3 = quartiles(ratios)
    return {"speedup": round(median, digits), "speedup_iqr": [round(q1, digits), round(q3, digits)],
            "ratios": [round(r, digits) for r in ratios]}

