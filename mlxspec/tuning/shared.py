"""Costs for a target sharded over several processes (``mlx.launch``): measured once a process,
on every rank together, and rank 0's figures used by all.

Each forward of a sharded target is a collective, so every rank runs the same measuring
forwards in the same order: no time budget (that would cut each rank's schedule by its own
clock), fixed widths and repetitions. The ranks' clocks still differ, so rank 0's results are
handed to the others (``engine.ranks.share``): every gate then decides from the same numbers
and the ranks stay in step. Nothing is read from or written to the tune records: those hold
one process's costs on this machine, not a sharded run's (whose forwards wait on the link).
Before this, a sharded run decided on the default curve, which priced a 3-row verify at 1.16
forwards and a plain token at 1 where one GPU measured 1.47 and 0.84 (8B shape), and on two
GPUs a 2-16 token forward at 1.08-2.2 where it cost 4.6-6.4x (then MLX's CUDA attention built
a graph per key length: a sharded target had none of mlxspec's kernels; docs/distributed.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from ..engine import watchdog
from ..engine.costs import measure_tree_factor, measure_verify_cost
from ..engine.gates import CostModel
from ..engine.ranks import share
from .measure import draft_step_cost

SHARED_REPS = 2  # repetitions of each width (every rank runs them all; the fastest counts)
SHARED_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16)  # verify widths timed; those between, interpolated
CONTEXT = 64  # tokens in the cache while timing (prefilled by every rank, for each measurement)


@dataclass
class SharedCosts:
    """What a sharded run's gates weigh, identical on every rank."""

    cost: CostModel
    draft_cost: dict[str, float]  # per drafter, measured when first asked
    trees_timed: bool = False  # tree verifies timed (cost.tree_factor; None: this target has none)


def measure_shared(spec, drafter: str, trees: bool, known: SharedCosts | None,
                   on_status: Callable[[str], None] | None = None) -> SharedCosts:
    """KNOWN completed for DRAFTER (and tree verifies when TREES): what is missing is measured
    on every rank of SPEC's group together, and rank 0's figures are shared. Every rank must
    call this with the same arguments at the same point (they run the same requests)."""
    group = spec.target.group
    model, vocab = spec.target.model, spec.target.vocab_size
    mine: dict = {}
    with watchdog.watching():
        if known is None:
            if on_status:
                on_status("measuring the verify cost over the ranks (once per process)")
            cost = measure_verify_cost(model, SHARED_WIDTHS, context=CONTEXT, reps=SHARED_REPS, vocab=vocab,
                                       on_progress=lambda done, total: watchdog.progress())
            mine.update(figures(cost))
        needs_tree = trees and (known is None or not known.trees_timed)
        if needs_tree:
            mine["tree_factor"] = measure_tree_factor(model, context=CONTEXT, reps=SHARED_REPS, vocab=vocab)
            watchdog.progress()
        if drafter != "pld" and (known is None or drafter not in known.draft_cost):
            if on_status:
                on_status(f"timing the {drafter} drafter over the ranks (once per process)")
            mine["draft_cost"] = draft_step_cost(spec, drafter, CONTEXT, SHARED_REPS)
            watchdog.progress()
        if not mine:
            return known
        got = rank0s(mine, group)
    return _merged(known, got, drafter)


def figures(cost: CostModel) -> dict:
    """COST's measured curve and plain-token factor, JSON-able (for :func:`rank0s`)."""
    return {"curve": {str(n): c for n, c in cost.curve.items()}, "plain": cost.plain}


def cost_of(got: dict) -> CostModel:
    """The measured cost model :func:`figures` wrote (after :func:`rank0s`: rank 0's)."""
    return CostModel(curve={int(n): float(c) for n, c in got["curve"].items()}, measured=True,
                     plain=float(got["plain"]))


def rank0s(mine: dict, group) -> dict:
    """Rank 0's MINE (a JSON-able dict of measured figures) on every rank of GROUP; MINE itself
    without a group (one process)."""
    if group is None:
        return json.loads(json.dumps(mine))  # the same types a shared one has
    return json.loads(share(json.dumps(mine).encode() if group.rank() == 0 else None, group))


def _merged(known: SharedCosts | None, got: dict, drafter: str) -> SharedCosts:
    """KNOWN with rank 0's figures GOT (see :func:`measure_shared`) added."""
    if known is None:
        known = SharedCosts(cost_of(got), {})
    if "tree_factor" in got:
        known.cost.tree_factor, known.trees_timed = got["tree_factor"], True
    if "draft_cost" in got:
        known.draft_cost[drafter] = float(got["draft_cost"])
    return known
