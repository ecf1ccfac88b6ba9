"""Temperature > 0 with a DFlash drafter: the committed tokens follow plain sampling's
distribution, drafted and scored at several positions.

The engine drafts 3 tokens per step (each from its own block position's q_i) and the first 3
committed tokens are scored JOINTLY against their exact distribution (enumerated with the
target), together with the pair and the ranks (stats_helpers.battery_keys).

Power, computed beside the test (``test_the_test_has_power``, simulated: stats_helpers.
simulated_power): against the alternative "the token at position 2 is off by 3 points of
probability" (in every context, 0.03 of its conditional moves from the most likely token to the
least likely one: stats_helpers.shift_at), N = 300 draws give the battery (joint, pair, and the
ranks of tokens 2 and 3 in their context, each at ALPHA / 4) a power of 0.94 (>= 0.9, the
house minimum; 250 would give 0.89, 500 gave 0.997) with this target at temperature 0.3; the
rank tests carry it. A planted rule that accepts every position against
q_1 (the first block position's distribution) instead of its own q_i must fail the same test:
p < 1e-9 at N_PLANTED = 150 (measured: 1e-52; below double precision at 300).

The loop drafts chains here (tree=0): Leviathan/Chen with each position's own q_i. Trees at
temperature > 0 are tests/test_tree_distribution.py's.
"""

from collections import Counter

import mlx.core as mx
import pytest

from mlxspec.engine.drafters.base import Draft
from mlxspec.engine.drafters.dflash import DFlashDrafter
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from stats_helpers import battery_keys, battery_pvalues, exact_joint, shift_at, simulated_power

ALPHA = 1e-3  # false-alarm rate of the whole battery
PARAMS = SamplingParams(temperature=0.3, top_p=0.98, min_p=0.01)  # peaked: the most power a draw
PROMPT = [2, 3, 2, 3, 2, 3, 2]
LENGTH, DEPTH = 3, 3
N = 300  # from the power computation below (0.94)
N_PLANTED = 150


def battery(counts: Counter, probs: dict, n: int) -> dict:
    """p-values of the joint (3 tokens), the pair and the rank of tokens 2 and 3 in their
    context (stats_helpers.battery_keys), each tested at ALPHA / 4."""
    return battery_pvalues(counts, probs, n, battery_keys(probs, LENGTH))


def rejects(pvalues: dict) -> bool:
    return min(pvalues.values()) < ALPHA / len(pvalues)


def sample(target, drafter, n):
    dec = SpeculativeDecoder(target, drafter=drafter, gates=False, depth=DEPTH, tree=0)  # chains
    counts, reached, trees = Counter(), [0] * DEPTH, 0
    for i in range(n):
        out, stats = [], None
        for toks, stats in dec.generate(PROMPT, sampling=PARAMS, max_tokens=LENGTH + 1, seed=50_000 + i):
            out.extend(toks)
        counts[tuple(out[:LENGTH])] += 1
        for pos, d in enumerate(stats.position_drafted[:DEPTH]):
            reached[pos] += d - stats.position_accepted[pos]  # rejections at each position
        trees += stats.tree_steps
    return counts, reached, trees


def test_the_test_has_power(vocab8_dflash):
    target, _ = vocab8_dflash
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)
    alt = shift_at(probs, 1)  # position 2 (index 1) off by 3 points
    power = simulated_power(probs, alt, N, ALPHA, battery_keys(probs, LENGTH))
    assert power >= 0.9, power


class PositionalDFlash(DFlashDrafter):
    """The random tiny drafter with a different token favoured at each block position: its
    q_i differ from one position to the next as a trained drafter's do (a random one's barely
    do), so a rule that mixes positions up shows."""

    def block_logits(self, tokens, k):
        logits = super().block_logits(tokens, k)
        if logits is None:
            return None
        favoured = mx.array([(3 * i + 1) % logits.shape[-1] for i in range(k)])
        bias = (mx.arange(logits.shape[-1])[None] == favoured[:, None]).astype(logits.dtype) * 4.0
        return logits + bias


class FirstQEverywhere(PositionalDFlash):
    """Planted bug: each drafted token is drawn from its own q_i, but acceptance is told q_1."""

    def propose(self, tokens, k, sampling):
        draft = super().propose(tokens, k, sampling)
        if draft is None or draft.logprobs is None:
            return draft
        wrong = mx.broadcast_to(draft.logprobs[:1], draft.logprobs.shape)
        return Draft(draft.tokens, wrong, draft.host)


@pytest.mark.slow
def test_dflash_sampling_is_exact_at_every_position(vocab8_dflash):
    target, model = vocab8_dflash
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)
    counts, rejected, trees = sample(target, PositionalDFlash(model, target), N)
    assert all(r > 50 for r in rejected), rejected  # rejections at positions 1, 2 and 3
    assert trees == 0  # chains: Leviathan/Chen with each position's q_i
    pvalues = battery(counts, probs, N)
    assert not rejects(pvalues), pvalues


@pytest.mark.slow
def test_the_planted_wrong_q_is_caught(vocab8_dflash):
    target, model = vocab8_dflash
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)
    counts, _, _ = sample(target, FirstQEverywhere(model, target), N_PLANTED)
    assert min(battery(counts, probs, N_PLANTED).values()) < 1e-9
