"""Penalties and logit bias with speculation on: exact at temperature 0 (token for token what
mlx-lm's generate_step gives with the same processors) and in distribution at temperature > 0.

Distribution test: a vocab-8 target with a repetition + presence + frequency penalty over a
window of 3 tokens, which the drafts before each verify row reach into, drafting 3 tokens a
step with itself (unpenalised) as the draft model; the first 3 committed tokens are scored
jointly and as the pair against their exact distribution (enumerated with the processors
applied to each prefix, as plain decoding does).

Power (``test_the_test_has_power``, simulated beside it): against "the token at position 2 is
off by 3 points" (stats_helpers.shift_at) the battery (joint, pair, ranks of tokens 2 and 3,
each at ALPHA / 4) at N draws has power >= 0.9. The
planted bug is the natural one: every verify row penalised as if the drafts before it were not
there (the committed history only); it must fail with p < 1e-6 at N_PLANTED draws.
"""

from collections import Counter

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlxspec.api import GenerationRequest
from mlxspec.engine.penalties import Penalties
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.errors import UsageError
from stats_helpers import battery_keys, battery_pvalues, shift_at, simulated_power

# -- temperature 0: token for token ------------------------------------------------------------

PENALTIES = Penalties(repetition=1.3, presence=0.4, frequency=0.3, window=12, logit_bias=((5, 1.5), (9, -2.0)))
PROMPT_TEXT = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny ="


def mlx_lm_greedy(model, prompt, penalties: Penalties, n):
    procs = make_logits_processors(dict(penalties.logit_bias) or None, penalties.repetition, penalties.window,
                                   penalties.presence or None, penalties.window,
                                   penalties.frequency or None, penalties.window)
    steps = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=procs)
    return [tok for (tok, _), _ in zip(steps, range(n))]


def speculate(model, prompt, n, penalties=None, **kw):
    dec = SpeculativeDecoder(model, gates=False, **kw)
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=n, penalties=penalties):
        out.extend(toks)
    return out, stats


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    return mlx_lm.load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def greedy_references(qwen3):
    """mlx-lm's greedy tokens with PENALTIES and without (deterministic: decoded once for the
    three drafters below)."""
    model, tok = qwen3
    prompt = tok.encode(PROMPT_TEXT)
    n = 40
    return prompt, n, mlx_lm_greedy(model, prompt, PENALTIES, n), mlx_lm_greedy(model, prompt, Penalties(), n)


@pytest.mark.parametrize("drafter", ["pld", "draft", "none"])
def test_greedy_with_penalties_is_mlx_lm_token_for_token(qwen3, greedy_references, tiny_qwen3_draft, drafter):
    model, _ = qwen3
    prompt, n, reference, unpenalised = greedy_references
    assert reference != unpenalised  # the penalties change this output: the test can fail
    draft = mlx_lm.load(str(tiny_qwen3_draft))[0] if drafter == "draft" else None
    out, stats = speculate(model, prompt, n, PENALTIES, drafter=drafter, draft_model=draft, depth=3)
    assert out == reference
    if drafter != "none":
        assert stats.drafted > 0


def test_a_forced_token_through_the_api(qwen3, tiny_qwen3):
    from mlxspec.api import load

    spec = load(str(tiny_qwen3))
    text = "".join(c.text for c in spec.stream("hello", GenerationRequest(max_tokens=6, logit_bias={7: 100.0},
                                                                         drafter="pld", raw=True)))
    assert text == spec.tokenizer.decode([7] * 6)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        list(spec.stream("hello", GenerationRequest(max_tokens=2, logit_bias={10**6: 1.0})))


# -- temperature > 0: in distribution ----------------------------------------------------------

ALPHA = 1e-3
PARAMS = SamplingParams(temperature=0.7, top_p=0.98, min_p=0.01)
DIST_PENALTIES = Penalties(repetition=1.6, presence=0.5, frequency=0.4, window=3)  # as the planted one below
DIST_PROMPT = [2, 3, 4, 5, 2, 3, 4, 5, 2]
LENGTH, DEPTH = 3, 3
N = 800
N_PLANTED = 150


def exact_joint_penalised(model, prompt, length, params, penalties):
    """P(next LENGTH tokens) under plain sampling with PENALTIES on each prefix's row."""
    probs = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, pr in probs.items():
            history = prompt + list(seq)
            logits = model(mx.array(history)[None])[0, -1:]
            logits = penalties.apply(history, [], logits)
            p = np.exp(np.array(params.logprobs(logits)[0], dtype=np.float64))
            for tok, pt in enumerate(p):
                if pt > 0:
                    nxt[seq + (tok,)] = pr * pt
        probs = nxt
    return probs


@pytest.fixture(scope="module")
def vocab8(tiny_vocab8):
    model = mlx_lm.load(str(tiny_vocab8))[0]
    return model, exact_joint_penalised(model, DIST_PROMPT, LENGTH, PARAMS, DIST_PENALTIES)


class CommittedHistoryOnly(Penalties):
    """Planted bug: every verify row penalised after the committed tokens only."""

    def apply(self, history, drafts, logits):
        return mx.concatenate([Penalties.apply(self, history, [], logits[i : i + 1]) for i in range(logits.shape[0])])


def sample(model, penalties, n):
    # the target drafts for itself, unpenalised: its q differs from the penalised p, and drafts
    # land in the window the rows after them count
    dec = SpeculativeDecoder(model, drafter="draft", draft_model=model, gates=False, depth=DEPTH)
    counts, rejected = Counter(), [0] * DEPTH
    for i in range(n):
        out, stats = [], None
        for toks, stats in dec.generate(DIST_PROMPT, sampling=PARAMS, max_tokens=LENGTH + 1, seed=7_000 + i,
                                        penalties=penalties):
            out.extend(toks)
        counts[tuple(out[:LENGTH])] += 1
        for pos, d in enumerate(stats.position_drafted[:DEPTH]):
            rejected[pos] += d - stats.position_accepted[pos]
    return counts, rejected


def pvalues(counts, probs, n):
    """The joint, the pair and the ranks of tokens 2 and 3 (stats_helpers.battery_keys)."""
    return battery_pvalues(counts, probs, n, battery_keys(probs, LENGTH))


def test_the_test_has_power(vocab8):
    _, probs = vocab8
    power = simulated_power(probs, shift_at(probs, 1), N, ALPHA, battery_keys(probs, LENGTH))
    assert power >= 0.9, power


@pytest.mark.slow
def test_penalised_sampling_is_exact_at_every_position(vocab8):
    model, probs = vocab8
    counts, rejected = sample(model, DIST_PENALTIES, N)
    assert all(r > 30 for r in rejected), rejected  # rejections at positions 1, 2 and 3
    p = pvalues(counts, probs, N)
    assert min(p.values()) >= ALPHA / len(p), p


@pytest.mark.slow
def test_the_planted_history_bug_is_caught(vocab8):
    model, probs = vocab8
    planted = CommittedHistoryOnly(repetition=1.6, presence=0.5, frequency=0.4, window=6)
    counts, _ = sample(model, planted, N_PLANTED)
    assert min(pvalues(counts, probs, N_PLANTED).values()) < 1e-6
