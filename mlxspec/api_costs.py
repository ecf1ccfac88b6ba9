"""The measured costs a :class:`~mlxspec.api.SpecModel` decides depths with: the stored ones
for this machine and model, else measured once (announced, within a time budget) and stored."""

from __future__ import annotations

import time
from typing import Callable

from .options import CONTEXT_COST_FROM, VERIFY_CONTEXT_BUDGET_S, VERIFY_COST_BUDGET_S

DRAFTER_PARTS = {"draft": "draft model", "mtp": "MTP head", "assistant": "Gemma-4 assistant"}


def _announce(label: str, budget_s: float, on_status: Callable[[str], None] | None):
    """Show LABEL, then (as the returned callback is told forwards done of a total) its
    progress: the share done, or of BUDGET_S spent, whichever is more."""
    if on_status is None:
        return None
    on_status(label)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        share = max(done / total, (time.perf_counter() - started) / budget_s)
        on_status(f"{label}: {min(100, int(100 * share))}%")

    return progress


class MeasuredCosts:
    """Mixed into SpecModel: needs ``target``, ``draft``, ``_cost`` and ``_draft_costs``."""

    def verify_cost(self, on_status: Callable[[str], None] | None = None, horizon: int = 0):
        """Measured cost of verifying 1..16 tokens with this model: the curve stored for this
        machine and model (by `mlxspec tune` or an earlier run), else measured now within
        VERIFY_COST_BUDGET_S, announced to ON_STATUS with its progress, and stored for the next
        runs. A request that may reach HORIZON >= CONTEXT_COST_FROM tokens also needs how the
        costs grow with the context (:meth:`context_cost`)."""
        if self._cost is None:
            from .tuning.storage import stored_cost

            self._cost = stored_cost(self.target)
        if self._cost is None:
            from .engine.costs import measure_verify_cost
            from .tuning.storage import save_cost

            progress = _announce("measuring this machine's verify cost (once per model, then stored)",
                                 VERIFY_COST_BUDGET_S, on_status)
            self._cost = measure_verify_cost(self.target.model, vocab=self.target.vocab_size,
                                             budget_s=VERIFY_COST_BUDGET_S, on_progress=progress)
            save_cost(self.target, self._cost)
        if horizon >= CONTEXT_COST_FROM and not self._cost.context_known:
            self.context_cost(self._cost, on_status)
        return self._cost

    def context_cost(self, cost, on_status: Callable[[str], None] | None = None) -> None:
        """Time COST's forwards over long contexts (engine/context_cost.py) within
        VERIFY_CONTEXT_BUDGET_S, announced, and add them to the stored record."""
        from .engine.context_cost import measure_context_cost
        from .engine.costs import CURVE_CONTEXT
        from .tuning.storage import save_context_cost

        progress = _announce("measuring how the verify cost grows with the context (once per model)",
                             VERIFY_CONTEXT_BUDGET_S, on_status)
        measure_context_cost(self.target.model, cost, cost.context or CURVE_CONTEXT, vocab=self.target.vocab_size,
                             budget_s=VERIFY_CONTEXT_BUDGET_S, on_progress=progress)
        save_context_cost(self.target, cost)

    def draft_cost(self, drafter: str, on_status: Callable[[str], None] | None = None) -> float:
        """One step of ``drafter`` ("draft", "mtp" or "assistant") relative to one target forward, timed
        now (once per load, announced to ON_STATUS) and added to the stored record. The weight
        bytes guess the drafters fall back on missed by 4x: a Qwen3-0.6B-shaped draft step
        cost 0.6 of a Qwen3-8B-shaped forward on CUDA against 0.15 by bytes, and the gates kept
        a draft model that ran at 0.58x plain."""
        if drafter not in self._draft_costs:
            from .tuning.measure import draft_step_cost
            from .tuning.storage import save_draft_cost

            if on_status:
                on_status(f"timing the {DRAFTER_PARTS.get(drafter, drafter)} (once per model)")
            cost = draft_step_cost(self, drafter, context=128, reps=3)
            self._draft_costs[drafter] = cost
            save_draft_cost(self.target, drafter, cost, self.draft)
        return self._draft_costs[drafter]

    def _measure_tree_factor(self, cost, on_status) -> None:
        """Time tree forwards against chain verifies once per model, kept in the stored record."""
        from .engine.costs import measure_tree_factor
        from .tuning.storage import save_tree_factor

        if on_status:
            on_status("timing draft-tree verifies (once per model)")
        factor = measure_tree_factor(self.target.model, vocab=self.target.vocab_size)
        if factor is not None:
            cost.tree_factor = factor
            save_tree_factor(self.target, factor)
