"""The repetitions of ``mlxspec bench --real-shapes`` and what each cell reports.

:func:`measure` runs one shape's cells ABAB (:func:`.paired.abab`): every cell's run right after
a run of stock mlx-lm on the same workload and temperature, repetition after repetition, so each
run has its own baseline next to it. :func:`summarize` turns them into the cells of the JSON
(:data:`CELL_KEYS` first, then details): ``speedup`` is the median over repetitions of the
paired ratio (the cell's tok/s over its baseline run's), ``speedup_iqr`` their [q1, q3]; ``ideal``
is :meth:`.real_shapes.ShapeBench.ideal` per repetition against that repetition's baseline
per-token time (``plain_ms``, median in the cell), its median in the cell, and
``achieved_over_ideal`` the median of the per-repetition ratios of the two.
"""

from __future__ import annotations

import statistics

from .paired import abab, paired_speedup, quartiles
from .real_plan import BASELINE, MLX_LM_DRAFT_DEPTH, STOCK_DRAFT, Cell

# what every cell carries (issue 29), in this order
CELL_KEYS = ("shape", "workload", "engine", "depth", "context_tokens", "reps", "speedup", "speedup_iqr",
             "ideal", "achieved_over_ideal", "acceptance", "tokens_per_step", "identical")


def baseline_of(cell: Cell) -> Cell:
    """The stock mlx-lm cell a cell is paired with: same workload, same temperature."""
    return Cell(cell.workload, BASELINE, None, cell.temperature)


def measure(bench, cells: list[Cell], reps: int, say=None, on_rep=None) -> tuple[dict, dict]:
    """``reps`` repetitions of :func:`.paired.abab` over ``cells``, each run by ``bench.run``.
    Returns (runs, pairs): per cell key its runs, and the baseline run paired with each (a
    baseline cell's runs are paired with themselves). ``on_rep(rep, runs, pairs)`` after each
    repetition."""
    say = say or (lambda *a: None)
    order = abab(cells, baseline_of)
    runs: dict = {c.key: [] for c in cells}
    pairs: dict = {c.key: [] for c in cells}
    for rep in range(reps):
        for base, cell in order:
            say(f"rep {rep + 1}/{reps} {base.workload} {base.engine}")
            b = bench.run(base)
            runs.setdefault(base.key, []).append(b)
            pairs.setdefault(base.key, []).append(b)
            if cell is not None:
                say(f"rep {rep + 1}/{reps} {cell.workload} {cell.engine}"
                    + (f" depth {cell.depth}" if cell.depth else "") + (f" tree {cell.tree}" if cell.tree else ""))
                runs[cell.key].append(bench.run(cell))
                pairs[cell.key].append(b)
        if on_rep is not None:
            on_rep(rep, runs, pairs)
    return runs, pairs


def shape_info(bench, bits: int) -> dict:
    """What one shape measured besides its cells (costs, drafters' steps, tree verifies), and
    the stock baseline process's evidence (:mod:`.stock_evidence`)."""
    from .report import compiled_graphs

    d = bench.dflash
    return {"shape": bench.shape, "bits": bits, "build_s": round(bench.build_s, 1),
            "weights_mb": round(bench.target_nbytes / 1e6, 1),
            "forward_ms": {str(k): round(v, 3) for k, v in bench.forward.items()},
            "draft_step_ms": {k: round(v, 3) for k, v in bench.draft_step_ms.items()},
            "cost_curve": {str(k): round(v, 3) for k, v in sorted(bench.cost.curve.items())},
            "cost_plain_step": round(bench.cost.plain, 3),
            "cost_context": bench.cost.context_record(3),  # the curve over long contexts, as the gate read it
            "tree_ms": {str(k): round(v, 3) for k, v in bench.tree_ms.items()},
            "tree_factor": bench.cost.tree_factor, "tree_error": bench.tree_error,
            "dflash": None if d is None else {"layers": d.args.num_hidden_layers, "block_size": d.block_size,
                                              "target_layer_ids": list(d.args.target_layer_ids)},
            # this shape's compiled graphs (the last shape's went with its model)
            "compiled_graphs": compiled_graphs(),
            "baseline": BASELINE, "baseline_evidence": bench.stock_evidence}


def summarize(bench, cells: list[Cell], runs: dict, pairs: dict) -> list[dict]:
    """One JSON cell per cell that has runs (:data:`CELL_KEYS` first)."""
    return [cell_summary(bench, cell, runs[cell.key], pairs[cell.key]) for cell in cells if runs.get(cell.key)]


def cell_summary(bench, cell: Cell, mine: list, base: list) -> dict:
    # a run of one token (or one step) has no decode time: no rate, no ratios
    timed = all(r.tps for r in mine + base)
    paired = paired_speedup([r.tps for r in mine], [b.tps for b in base])
    plain = [1e3 / b.tps for b in base] if timed else []
    ideals = [bench.ideal(cell, r, p) for r, p in zip(mine, plain)]
    ideal = statistics.median(ideals) if ideals and None not in ideals else None
    achieved = (statistics.median(r / i for r, i in zip(paired["ratios"], ideals)) if ideal else None)
    tq1, tps, tq3 = quartiles([r.tps for r in mine]) if timed else (None,) * 3
    want = bench.scripts[cell.workload].continuation[: bench.max_tokens]
    out = {
        "shape": bench.shape, "workload": cell.workload, "engine": cell.engine,
        "depth": cell.depth if cell.depth is not None else "auto",
        "context_tokens": len(bench.scripts[cell.workload].prompt), "reps": len(mine),
        "speedup": paired["speedup"], "speedup_iqr": paired["speedup_iqr"],
        "ideal": round(ideal, 3) if ideal else None,
        "achieved_over_ideal": round(achieved, 3) if achieved else None,
        **engine_counts(cell, mine),
        "identical": all(r.tokens == want for r in mine),
        "baseline": BASELINE, "temperature": cell.temperature,
        "tree": "auto" if cell.tree is None else cell.tree,
        "tps": round(tps, 2) if timed else None,
        "tps_iqr": [round(tq1, 2), round(tq3, 2)] if timed else None,
        "baseline_tps": round(statistics.median(b.tps for b in base), 2) if timed else None,
        "plain_ms": round(statistics.median(plain), 3) if timed else None,
        "speedup_reps": paired["ratios"],
        "speedup_of_medians": (round(tps / statistics.median(b.tps for b in base), 3) if timed else None),
        "reps_tps": [round(r.tps, 2) if r.tps else None for r in mine],
        "baseline_reps_tps": [round(b.tps, 2) if b.tps else None for b in base],
    }
    return out | engine_details(mine)


def engine_counts(cell: Cell, mine: list) -> dict:
    """``acceptance`` (accepted / drafted over all repetitions) and ``tokens_per_step`` (tokens
    per target forward)."""
    drafted = sum(r.stats["drafted"] for r in mine) if mine[0].stats else None
    accepted = sum(r.stats["accepted"] for r in mine) if mine[0].stats else None
    steps = [r.stats["verify_steps"] + r.stats["plain_steps"] if r.stats
             else len(r.tokens) - (r.from_draft or 0) for r in mine]
    if cell.engine == STOCK_DRAFT:
        drafted = sum(MLX_LM_DRAFT_DEPTH * s for s in steps)
        accepted = sum(r.from_draft for r in mine)
    return {"acceptance": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_step": round(sum(len(r.tokens) for r in mine) / sum(steps), 3) if sum(steps) else None}


def engine_details(mine: list) -> dict:
    """What mlxspec's engines report besides: depths, queued verifies, trees, gate events."""
    trees = [t for r in mine for t in r.trees or ()]
    stats = mine[0].stats is not None
    return {
        "mean_depth": round(statistics.mean(r.stats["mean_depth"] for r in mine), 2) if stats else None,
        "queued_used": sum(r.stats.get("queued_used", 0) for r in mine) if stats else None,
        "queued_dropped": sum(r.stats.get("queued_dropped", 0) for r in mine) if stats else None,
        # compiled verify graphs traced inside the timed repetitions (each costs a model's build
        # and MLX's compile on the host; the warm-up should have traced them all)
        "compiled_traces": sum(r.stats.get("compiled_traces", 0) for r in mine) if stats else None,
        "tree_steps": len(trees) if mine[0].trees is not None else None,
        "mean_tree_nodes": round(statistics.mean(n for n, _ in trees), 2) if trees else None,
        "tree_note": mine[-1].stats.get("tree_note") if stats else None,
        "gate_events": mine[-1].stats["gate_events"] if stats else None,
    }
