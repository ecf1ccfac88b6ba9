"""Temperature > 0: speculation samples from exactly the distribution plain sampling does.

Each test compares counts with exact probabilities by a chi-square test, and shows the same
test rejecting a deliberately biased acceptance rule, so a pass means something.
"""

from collections import Counter

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import tiny
from mlxspec.engine import speculate as speculate_mod
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.sampling import SamplingParams, accept_sampled
from mlxspec.engine.speculate import SpeculativeDecoder
from stats_helpers import chi_square_p, exact_joint

ALPHA = 1e-3  # false-alarm rate of each chi-square test
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, top_k=6, min_p=0.02)


# -- the acceptance rule on fixed distributions ------------------------------------------

def _first_token_counts(rule, p_logits, q_logits, n, seed=0):
    """The first committed token of a depth-2 step, drafted from q."""
    mx.random.seed(seed)
    p_lp = PARAMS.logprobs(p_logits)
    q_lp = PARAMS.logprobs(q_logits)
    counts = Counter()
    for _ in range(n):
        draft = mx.random.categorical(q_lp).astype(mx.uint32)
        n_acc, out = rule(p_lp, draft, q_lp)
        first = draft[0] if n_acc.item() > 0 else out[0]
        counts[first.item()] += 1
    return counts, np.exp(np.array(p_lp[0]))


def biased_rule(p_lp, draft, q_lp):
    """Accepts with p/q but resamples rejects from p instead of max(p - q, 0): biased."""
    n, out = accept_sampled(p_lp, draft, q_lp)
    resample = mx.random.categorical(p_lp[: draft.shape[0]])
    return n, mx.concatenate([resample, out[-1:]])


def test_acceptance_rule_keeps_target_distribution():
    mx.random.seed(42)
    p_logits = mx.random.normal((3, 12)) * 1.5
    q_logits = mx.random.normal((2, 12)) * 1.5
    n = 6000
    counts, p0 = _first_token_counts(accept_sampled, p_logits, q_logits, n)
    probs = {i: float(x) for i, x in enumerate(p0)}
    assert chi_square_p(counts, probs, n) > ALPHA
    bad, _ = _first_token_counts(biased_rule, p_logits, q_logits, n)
    assert chi_square_p(bad, probs, n) < ALPHA


def test_processing_matches_mlx_lm_sampler():
    """Our processed distribution is the one mlx-lm's own sampler draws from."""
    mx.random.seed(7)
    logits = mx.random.normal((1, 10)) * 2.0
    sampler = make_sampler(temp=PARAMS.temperature, top_p=PARAMS.top_p, min_p=PARAMS.min_p, top_k=PARAMS.top_k)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    n = 6000
    counts = Counter(sampler(lp).item() for _ in range(n))
    probs = {i: float(x) for i, x in enumerate(np.exp(np.array(PARAMS.logprobs(logits)[0])))}
    assert chi_square_p(counts, probs, n) > ALPHA


# -- the whole engine on a tiny-vocabulary model -------------------------------------------

PROMPT = [2, 3, 2, 3, 2, 3, 2]  # repeats, so prompt lookup proposes constantly
LENGTH = 2


@pytest.fixture(scope="module")
def vocab8(tiny_vocab8, tmp_path_factory):
    target = mlx_lm.load(str(tiny_vocab8))[0]
    other = tiny.write_checkpoint(tmp_path_factory.mktemp("vocab8_draft"), "llama", vocab_size=8, seed=11)
    return target, mlx_lm.load(str(other))[0]


def sample_engine(model, n, **kw):
    dec = SpeculativeDecoder(model, gates=False, **kw)
    counts, drafted = Counter(), 0
    for i in range(n):
        out, stats = [], None
        for toks, stats in dec.generate(PROMPT, sampling=PARAMS, max_tokens=LENGTH, seed=10_000 + i):
            out.extend(toks)
        counts[tuple(out)] += 1
        drafted += stats.drafted
    return counts, drafted


@pytest.mark.slow
def test_engine_distribution_is_exact(vocab8):
    target, draft = vocab8
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)
    assert sum(p > 0.02 for p in probs.values()) >= 6  # a broad distribution, not one-hot
    n = 1500
    mx.random.seed(0)
    sampler = make_sampler(temp=PARAMS.temperature, top_p=PARAMS.top_p, min_p=PARAMS.min_p, top_k=PARAMS.top_k)
    plain = Counter()
    for _ in range(n):
        steps = generate_step(mx.array(PROMPT), target, max_tokens=LENGTH, sampler=sampler)
        plain[tuple(t for (t, _), _ in zip(steps, range(LENGTH)))] += 1
    assert chi_square_p(plain, probs, n) > ALPHA  # the enumeration is what mlx-lm samples

    lookup = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    for kw in ({"drafter": lookup, "depth": 1}, {"drafter": "draft", "draft_model": draft, "depth": 1}):
        counts, drafted = sample_engine(target, n, **kw)
        assert drafted >= n // 2
        assert chi_square_p(counts, probs, n) > ALPHA, kw


@pytest.mark.slow
def test_engine_catches_biased_acceptance(vocab8, monkeypatch):
    """The same test fails when drafts are always accepted: it can tell."""
    target, draft = vocab8
    probs = exact_joint(target, PROMPT, LENGTH, PARAMS)

    def accept_everything(params, target_lp, draft_tokens, draft_lp=None):
        k = draft_tokens.shape[0]
        return mx.array(k), mx.concatenate([draft_tokens, mx.argmax(target_lp[k:], axis=-1).astype(mx.uint32)])

    monkeypatch.setattr(speculate_mod, "accept", accept_everything)
    n = 800
    counts, _ = sample_engine(target, n, drafter="draft", draft_model=draft, depth=1)
    assert chi_square_p(counts, probs, n) < ALPHA


def test_acceptance_rate_matches_theory(vocab8):
    """P(accept first draft) = sum_x min(p(x), q(x))."""
    target, draft = vocab8
    p = np.exp(np.array(PARAMS.logprobs(target(mx.array(PROMPT)[None])[0, -1:])[0], dtype=np.float64))
    q = np.exp(np.array(PARAMS.logprobs(draft(mx.array(PROMPT)[None])[0, -1:])[0], dtype=np.float64))
    theory = float(np.minimum(p, q).sum())
    n = 1200
    dec = SpeculativeDecoder(target, draft_model=draft, drafter="draft", depth=1, gates=False)
    accepted = 0
    for i in range(n):
        for _, stats in dec.generate(PROMPT, sampling=PARAMS, max_tokens=2, seed=i):
            pass
        assert stats.position_drafted[0] == 1
        accepted += stats.position_accepted[0]
    sigma = (theory * (1 - theory) / n) ** 0.5
    assert abs(accepted / n - theory) < 4 * sigma + 1e-9, (accepted / n, theory)
    assert 0.05 < theory < 0.95  # the draft is neither useless nor a copy


def test_seeded_runs_are_reproducible(vocab8):
    target, draft = vocab8
    dec = SpeculativeDecoder(target, draft_model=draft, drafter="draft")

    def run():
        return [t for toks, _ in dec.generate(PROMPT, sampling=PARAMS, max_tokens=30, seed=123) for t in toks]

    assert run() == run()

