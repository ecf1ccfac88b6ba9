"""Temperature > 0 with draft trees in the loop: the committed tokens follow plain sampling's
distribution, trees of depth 3 drafted and the first 3 committed tokens scored jointly.

The DFlash drafter's trees at temperature > 0 are SAMPLED trees: each node's children drawn
i.i.d. from its block position's q, checked by SpecInfer's multi-candidate rule. This test is
the tree IN THE LOOP (the tree forward, the kept path, the drafter's context after a sibling was
accepted, the gate fed the chain inside the tree), with the battery of
tests/test_dflash_distribution.py at N_TREES draws.

Power (``test_the_tree_test_has_power``, simulated): N_TREES = 300 draws give the battery 0.94
(>= 0.9, the house minimum; 250 would give 0.89) against "position 2 off by 3 points of
probability" (stats_helpers.shift_at). The rule alone is
also tested on fixed distributions in tests/test_tree.py, where draws are cheap. The planted bug (SpecInfer's
rule without its residual: a rejected draw's successor tested against p instead of
norm(max(p - q, 0))) is caught with p < 1e-9 at N_TREES_PLANTED = 150 (measured: 1e-43; 1e-98 at
300).
"""

from collections import Counter

import pytest

from mlxspec.engine import tree as tree_mod
from mlxspec.engine.speculate import SpeculativeDecoder
from stats_helpers import battery_keys, exact_joint, shift_at, simulated_power
from test_dflash_distribution import (
    ALPHA,
    DEPTH,
    LENGTH,
    PARAMS,
    PROMPT,
    PositionalDFlash,
    battery,
    rejects,
)

BUDGET = 7  # nodes a tree: more than its depth, so siblings are drawn
N_TREES = 300  # power 0.94 (test_the_tree_test_has_power)
N_TREES_PLANTED = 150


def sample_trees(target, drafter, n):
    dec = SpeculativeDecoder(target, drafter=drafter, gates=False, depth=DEPTH, tree=BUDGET)
    counts, trees = Counter(), 0
    for i in range(n):
        out, stats = [], None
        for toks, stats in dec.generate(PROMPT, sampling=PARAMS, max_tokens=LENGTH + 1, seed=70_000 + i):
            out.extend(toks)
        counts[tuple(out[:LENGTH])] += 1
        trees += stats.tree_steps
    return counts, trees


def test_the_tree_test_has_power(vocab8_dflash):
    target, _ = vocab8_dflash
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)
    power = simulated_power(probs, shift_at(probs, 1), N_TREES, ALPHA, battery_keys(probs, LENGTH))
    assert power >= 0.9, power


@pytest.mark.slow
def test_sampled_trees_are_exact(vocab8_dflash):
    target, model = vocab8_dflash
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)
    counts, trees = sample_trees(target, PositionalDFlash(model, target), N_TREES)
    assert trees >= N_TREES  # every run verified at least one tree
    pvalues = battery(counts, probs, N_TREES)
    assert not rejects(pvalues), pvalues


@pytest.mark.slow
def test_the_rule_without_its_residual_is_caught(vocab8_dflash, monkeypatch):
    target, model = vocab8_dflash
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)
    monkeypatch.setattr(tree_mod, "_residual", lambda p, q: p)
    counts, _ = sample_trees(target, PositionalDFlash(model, target), N_TREES_PLANTED)
    assert min(battery(counts, probs, N_TREES_PLANTED).values()) < 1e-9
