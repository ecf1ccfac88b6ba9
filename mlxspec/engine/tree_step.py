"""Tree steps in the loop: verify a draft tree in one target forward, keep the accepted path.

Terms:
- chain step: k drafted tokens verified as one sequence (speculate.py);
- tree step: a DraftTree of N nodes (engine/tree.py) verified by ``tree_forward``, walked
  exactly (``tree.walk``: argmax at temperature 0, sample-and-descend or SpecInfer's rule
  above it), the accepted path kept by ``keep_path``;
- the chain inside a tree: node 1's first children down, i.e. what the drafter's chain of the
  same depth would have proposed. The gate's acceptance model is fed what THAT chain would
  have kept, so its estimates of chains stay unbiased while trees run.

:class:`TreePolicy` decides per step whether a tree pays and how many nodes it gets, from the
measured verify cost curve (a tree of N nodes costs a verify of N + 1 rows; a hybrid target
pays its level-by-level recurrence on top: ``tree_factor``) and the tokens per step each kind
of step has kept (decayed means; no wall clock, so a seeded run decides the same each time).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..options import MAX_TREE
from .gates import CostModel
from .tree import DraftTree, walk
from .tree_forward import TreeUnsupported, keep_path, tree_forward

MAX_BUDGET = MAX_TREE  # nodes of the largest tree (a verify of 33 rows)
BUDGET_COST = 1.3  # a tree may cost this much more than the chain it stands for
PROBE_EVERY = 32  # chain steps between trees tried again once they stopped paying
DECAY = 0.9
# a hybrid's tree forward over a chain verify of as many rows where none was measured: its
# recurrence runs once per tree level, and keep_path re-runs the kept path (a guess that keeps
# trees off hybrids until measured; `mlxspec tune` and the first dflash run measure it)
HYBRID_TREE_FACTOR = 2.0


@dataclass
class TreeOutcome:
    new: list[int]  # committed tokens: the accepted nodes', then the target's own
    accepted: int  # drafted tokens kept
    depth: int  # the tree's depth (the chain it stands for drafted this many)
    chain_accepted: int  # what the chain inside the tree would have kept


class TreePolicy:
    """Whether the next step verifies a tree, and its node budget.

    ``budget``: None chooses from the cost curve (auto), 0 never, N at most N nodes.
    ``tree_factor``: a tree forward's cost over a chain verify of as many rows (1 for
    attention-only targets: the same matmuls under another mask)."""

    def __init__(self, budget: int | None, cost: CostModel, tree_factor: float = 1.0):
        self.fixed = budget
        self.cost = cost
        self.factor = tree_factor
        self.tree_tokens: float | None = None  # decayed mean tokens per tree step
        self.off_for = 0  # chain steps left before a tree is tried again
        self.unsupported: str | None = None  # why this target cannot verify trees
        self.why_chain: str | None = None  # why the last auto choice was a chain (stats)

    @classmethod
    def for_target(cls, budget: int | None, cost: CostModel, recurrent: bool) -> "TreePolicy":
        """The policy with COST's measured tree factor, else the default for the target's kind."""
        factor = cost.tree_factor if cost.tree_factor is not None else (HYBRID_TREE_FACTOR if recurrent else 1.0)
        return cls(budget, cost, factor)

    def budget(self, k: int, chain_tokens: float, draft_cost: float = 0.0, context: int | None = None) -> int:
        """Nodes for the next step at depth K (0: a chain), given the tokens a chain of depth k
        is expected to keep (the gate's estimate) and the draft cost of the step, with the
        verify costs read over CONTEXT tokens (the gate's)."""
        if self.unsupported or self.fixed == 0 or k < 1:
            return 0
        if self.fixed is not None:
            return max(self.fixed, 1)

        def verify(n: int) -> float:
            return self.cost.verify(n, context)

        chain_cost = verify(k + 1) + draft_cost
        n = max((n for n in range(k + 1, MAX_BUDGET + 1)
                 if self.factor * verify(n + 1) + draft_cost <= BUDGET_COST * chain_cost), default=0)
        if n == 0:
            ratio = (self.factor * verify(k + 2) + draft_cost) / chain_cost
            self.why_chain = (f"a tree of {k + 1} nodes would cost {ratio:.2f}x the depth-{k} chain's verify "
                              f"(tree forward {self.factor:.2f}x a chain of as many rows)")
            return 0
        if self.off_for > 0:
            self.off_for -= 1
            return 0
        if self.tree_tokens is not None:
            tree_cost = self.factor * verify(n + 1) + draft_cost
            if self.tree_tokens / tree_cost < chain_tokens / chain_cost:
                self.why_chain = (f"trees of {n} nodes kept {self.tree_tokens:.2f} tokens a step for {tree_cost:.2f} "
                                  f"units, the chain {chain_tokens:.2f} for {chain_cost:.2f}")
                self.off_for = PROBE_EVERY
                return 0
        self.why_chain = None
        return n

    def observe(self, outcome: TreeOutcome) -> None:
        got = outcome.accepted + 1
        self.tree_tokens = got if self.tree_tokens is None else DECAY * self.tree_tokens + (1 - DECAY) * got


def chain_accepted(tree: DraftTree, path: list[int]) -> int:
    """Accepted nodes of PATH that the drafter's own chain holds: each the first child of
    the node before it (for a sampled tree, the first draw: the same test as a chain's)."""
    n = 0
    for parent, node in zip(path, path[1:]):
        kids = tree.children(parent)
        if not kids or kids[0] != node:
            break
        n += 1
    return n


def tree_step(run, tree: DraftTree) -> TreeOutcome:
    """Verify TREE after ``run.tokens`` (``run``: the loop's request state: target, drafter,
    sampling, tokens) and commit its accepted path; the caller records stats and gates."""
    target = run.target
    start = len(run.tokens) - 1  # committed in the cache; tokens[-1] is the tree's root
    logits = tree_forward(target, tree.inputs(run.tokens[-1]), tree.parents_with_root())
    path, nxt = walk(tree, run.sampling.logprobs(logits), run.sampling, key=run.sampling.draw_key())
    n = len(path) - 1
    if run.hidden_to_drafter:  # rows of the kept path, in order, before the cache is compacted
        run.drafter.add_hidden(target.hidden[mx.array(path)])
    keep_path(target, start, path)
    target.commit(start + 1 + n)
    on_chain = chain_accepted(tree, path)
    # a drafter that fed its own chain (a draft model) keeps it only as far as the path follows it
    run.drafter.rollback(start + 1 + on_chain)
    new = [tree.tokens[i - 1] for i in path[1:]] + [int(nxt)]
    return TreeOutcome(new, n, max(tree.depths()), on_chain)


__all__ = ["TreeOutcome", "TreePolicy", "TreeUnsupported", "chain_accepted", "tree_step"]
