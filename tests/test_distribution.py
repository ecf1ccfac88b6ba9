"""Temperature > 0: speculation samples from exactly the distribution plain sampling does, with
every drafter, drafted and scored at several positions.

Each case drafts DEPTH = 3 tokens a step (max_tokens = LENGTH + 1 = 4: the loop caps a draft at
the tokens left less one; a draw stops once LENGTH tokens are out) and scores the first
LENGTH = 3 committed tokens against their exact distribution (stats_helpers.exact_joint,
enumerated with the target): the joint of the 3, the pair, and the rank of tokens 2 and 3 in
their context (stats_helpers.battery_keys), each test at ALPHA / 4. Each case must reject drafts
at positions 1, 2 and 3 (counted at the acceptance itself: where each verify stopped; Stats'
position counts also count positions after an earlier rejection), so residuals are drawn at
later positions and the caches rolled back after partial accepts.

The cases here (those reading the target's hidden states or cache are in
tests/test_distribution_heads.py: mtp on a hybrid GatedDeltaNet target, nextn, assistant):
  pld     prompt lookup (q one-hot), its verifies queued ahead
  draft   a separate draft model, the prompt restored from a prefix cache after the first draw;
          its position-1 acceptance rate is sum_x min(p, q)
  cut     a regex constraint cuts a draft model's chain, drawn without the mask, after 1 or 2
          tokens: the token after the cut comes from the residual of the cut token's q
  masked  a draft model samples its chain under the constraint (nothing is cut)

Power, computed beside the test (``test_the_test_has_power``): against "the token at position 2
is off by 3 points of probability" (stats_helpers.shift_at: in every context 0.03 of its
conditional moves from the most likely token to the least likely one), each case's N draws give
the battery a power >= 0.9, simulated (stats_helpers.simulated_power: pooled cells of a few
expected draws, where the noncentral chi-square is off). Each case's prompt and temperature were
picked for a small N: sharp rows, whose least likely tokens are rare, so 3 points there show
(yet no position is nearly decided: the most likely token there has < 0.9).

Each case also runs with a planted wrong rule at position 2 (PLANTED, wrapping the engine's
acceptance) that the same battery catches with p < 1e-6 at its n_planted draws: acceptance told
position 1's q at position 2 (an off-by-one), or position 2 accepted without its test.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from functools import cached_property, partial
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from mlxspec.engine import speculate as speculate_mod
from mlxspec.engine.drafters.draft_model import DraftModelDrafter
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.prefix_cache import PrefixCache
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder
from mlxspec.options import ConstraintSpec
from stats_helpers import (
    battery_keys,
    battery_pvalues,
    chi_square_p,
    exact_joint,
    rank_at,
    regroup,
    shift_at,
    simulated_power,
)

ALPHA = 1e-3  # false-alarm rate of a case's whole battery
LENGTH = DEPTH = 3
PLANTED_P = 1e-6
MIN_REJECTIONS = 10  # at each of positions 1, 2 and 3
# the tiny vocab-8 checkpoints: 0-2 specials (2 = <|im_end|>), 3..7 = "a".."e"
REGEX = "[a-e]{4}"  # letters: the draft model's chains leave it (for a special token) anywhere
DRAFT_NOISE = 0.2  # the draft model: tiny_vocab8 with noise (see noisy_copy)
DRAFT_HEAT = 2.5  # the constrained cases' draft model samples at this temperature (HotDraftModel)


@dataclass
class Case:
    target: object
    prompt: list[int]
    params: SamplingParams
    n: int  # draws: power >= 0.9 (test_the_test_has_power)
    planted: str  # a key of PLANTED
    n_planted: int
    drafter: object = None  # a Drafter, or a name with draft_model / mtp_head
    draft_model: object = None
    mtp_head: object = None
    constraint: object = None  # () -> a fresh TokenConstraint
    allowed: object = None  # seq -> the tokens the constraint allows after it (exact_joint)
    prefix_cache: bool = False
    probs: dict = field(default_factory=dict)

    def exact(self) -> dict:
        if not self.probs:
            self.probs = exact_joint(self.target, self.prompt, LENGTH, self.params, self.allowed)
        return self.probs

    def decoder(self) -> SpeculativeDecoder:
        return SpeculativeDecoder(self.target, drafter=self.drafter, draft_model=self.draft_model,
                                  mtp_head=self.mtp_head, depth=DEPTH, gates=False, tree=0)


# -- planted wrong rules at position 2, each wrapping the engine's acceptance ---------------------

def _q_rows(draft, draft_lp, width):
    """The drafter's q rows, one-hot where it drafts deterministically (None)."""
    if draft_lp is not None:
        return draft_lp
    return mx.where(mx.arange(width)[None] == draft[:, None].astype(mx.int32), 0.0, -mx.inf)


def q1_at_2(real, params, target_lp, draft, draft_lp=None, cut_lp=None):
    """Acceptance told position 1's q at position 2 (an off-by-one in the q rows)."""
    if draft.shape[0] >= 2:
        q = _q_rows(draft, draft_lp, target_lp.shape[-1])
        draft_lp = mx.concatenate([q[:1], q[:1], q[2:]])
    return real(params, target_lp, draft, draft_lp, cut_lp)


def accept_at_2(real, params, target_lp, draft, draft_lp=None, cut_lp=None):
    """Position 2 accepted without its test (acceptance told q = p there)."""
    if draft.shape[0] >= 2:
        q = _q_rows(draft, draft_lp, target_lp.shape[-1])
        draft_lp = mx.concatenate([q[:1], target_lp[1:2], q[2:]])
    return real(params, target_lp, draft, draft_lp, cut_lp)


PLANTED = {"q1 at 2": q1_at_2, "accept at 2": accept_at_2}


# -- the cases ------------------------------------------------------------------------------------

def noisy_copy(src, dst, scale, seed=0):
    """The checkpoint in SRC copied to DST with Gaussian noise (SCALE times each matrix's
    standard deviation) added to its weight matrices: a drafter as close to it as a trained one
    (most drafts accepted, not all)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, w in sorted(mx.load(str(Path(src) / "model.safetensors")).items()):
        w = np.array(w, dtype=np.float32)
        if w.ndim >= 2:
            w = w + scale * w.std() * rng.standard_normal(w.shape).astype(np.float32)
        weights[name] = mx.array(w)
    mx.save_safetensors(str(Path(dst) / "model.safetensors"), weights, metadata={"format": "pt"})
    return dst


class HotDraftModel(DraftModelDrafter):
    """A draft model drawing its chain at temperatures of its own (q is what it drew from, so
    speculation stays exact): hotter than the target, its q differs from p where a wrong rule
    shows. ``masked``: under a constraint, drawn from the masked rows the engine hands it (at
    TEMPERATURES[0] throughout); unmasked, position i at TEMPERATURES[i] (None: the request's),
    as a drafter that does not know the constraint would, so its chains leave the language and
    are cut there."""

    name = "draft"

    def __init__(self, model, temperatures: tuple, masked: bool):
        super().__init__(model)
        self.temperatures, self.masked = temperatures, masked

    def propose(self, tokens, k, sampling):
        if self.masked:
            return super().propose(tokens, k, replace(sampling, temperature=self.temperatures[0]))
        plain = {f.name: getattr(sampling, f.name) for f in fields(SamplingParams)}
        rows = iter([SamplingParams(**{**plain, "temperature": t or sampling.temperature}) for t in self.temperatures])
        return super().propose(tokens, k, PerPosition(**plain, rows=rows))


@dataclass(frozen=True)
class PerPosition(SamplingParams):
    """Draws each row of a chain with the next of ROWS' parameters."""

    rows: object = None

    def sample_with_logprobs(self, logits):
        return next(self.rows).sample_with_logprobs(logits)


class Models:
    """The checkpoints the cases share, each built on first use (MKTEMP(name) gives a folder)."""

    def __init__(self, mktemp, vocab8):
        self.mktemp, self.vocab8_path = mktemp, vocab8

    @cached_property
    def vocab8(self):
        """tiny_vocab8 and its draft model (noisy_copy)."""
        draft = noisy_copy(self.vocab8_path, self.mktemp("vocab8_draft"), DRAFT_NOISE)
        return mlx_lm.load(str(self.vocab8_path))[0], mlx_lm.load(str(draft))[0]

    @cached_property
    def regex(self):
        """A fresh TokenConstraint for REGEX per call, and the tokens allowed after a sequence."""
        from mlxspec.api import load

        make = partial(load(str(self.vocab8_path)).constraint, ConstraintSpec("regex", REGEX))
        probe = make()

        def allowed(seq):
            row = probe.mask_after(list(seq))
            return np.zeros(8, bool) if row is None else np.array(row)[0]

        return make, allowed


def case_pld(m: Models) -> Case:
    target, _ = m.vocab8
    return Case(target, [2, 0, 6, 2, 0, 6, 2], SamplingParams(temperature=0.35), n=350, planted="q1 at 2",
                n_planted=60, drafter=PromptLookupDrafter(max_ngram=2, min_ngram=1))


def case_draft(m: Models) -> Case:
    target, draft = m.vocab8
    return Case(target, [2, 3, 2, 3, 2, 3, 2], SamplingParams(temperature=0.25), n=200,
                planted="accept at 2", n_planted=60, drafter="draft", draft_model=draft,
                prefix_cache=True)


def case_cut(m: Models) -> Case:
    (target, draft), (make, allowed) = m.vocab8, m.regex
    return Case(target, [3, 4, 6, 4, 7], SamplingParams(temperature=0.25), n=150, planted="accept at 2",
                n_planted=60, drafter=HotDraftModel(draft, (None, DRAFT_HEAT, DRAFT_HEAT), masked=False),
                constraint=make, allowed=allowed)


def case_masked(m: Models) -> Case:
    (target, draft), (make, allowed) = m.vocab8, m.regex
    return Case(target, [3, 4, 6, 4, 7], SamplingParams(temperature=0.25), n=150, planted="accept at 2",
                n_planted=60, drafter=HotDraftModel(draft, (DRAFT_HEAT,), masked=True), constraint=make,
                allowed=allowed)


CASES = {"pld": case_pld, "draft": case_draft, "cut": case_cut, "masked": case_masked}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_vocab8) -> Models:
    return Models(tmp_path_factory.mktemp, tiny_vocab8)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, models) -> Case:
    """Each case built once (its models; its exact distribution on first use)."""
    return CASES[request.param](models)


# -- the sampler ----------------------------------------------------------------------------------

@dataclass
class Sample:
    counts: Counter  # the first LENGTH committed tokens
    rejected: list[int]  # verifies that rejected a draft at position 1, 2, 3
    cut: Counter  # chains a constraint cut, by the drafted tokens kept
    cached: int  # draws whose prompt came from the prefix cache
    first_accepted: int  # draws whose first verify accepted position 1


def sample(case: Case, n: int, seed: int, monkeypatch, planted: str | None = None) -> Sample:
    """N draws of the first LENGTH committed tokens, the rule at position 2 PLANTED."""
    dec = case.decoder()
    cache = PrefixCache(1 << 26) if case.prefix_cache else None
    real = speculate_mod.accept
    rule = real if planted is None else partial(PLANTED[planted], real)
    rejected, cut, first, draw = [0] * (DEPTH + 1), Counter(), {}, [0]

    def spy(params, target_lp, draft, draft_lp=None, cut_lp=None):
        """The engine's acceptance (or the planted rule), noting where each verify rejected."""
        n_acc, out = rule(params, target_lp, draft, draft_lp, cut_lp)
        k, kept = draft.shape[0], n_acc.item()
        if cut_lp is not None:
            cut[k] += 1
        if kept < k or cut_lp is not None:  # a token cut is rejected too
            rejected[kept] += 1
        first.setdefault(draw[0], kept > 0)
        return n_acc, out

    monkeypatch.setattr(speculate_mod, "accept", spy)
    counts, cached = Counter(), 0
    for i in range(n):
        out, stats, draw[0] = [], None, i
        run = dec.generate(case.prompt, sampling=case.params, max_tokens=LENGTH + 1, seed=seed + i,
                           prefix_cache=cache, constraint=case.constraint() if case.constraint else None)
        for toks, stats in run:
            out.extend(toks)
            if len(out) >= LENGTH:
                break
        run.close()
        counts[tuple(out[:LENGTH])] += 1
        cached += stats.cached_tokens > 0
    monkeypatch.setattr(speculate_mod, "accept", real)
    return Sample(counts, rejected[:DEPTH], cut, cached, sum(first.values()))


# -- the checks (each case file runs them on its cases) --------------------------------------------

def check_power(case: Case) -> None:
    probs = case.exact()
    for i in range(LENGTH):  # no position nearly decided: drafts there are rejected, residuals drawn
        assert regroup(probs, rank_at(probs, i))[0] < 0.9, i
    power = simulated_power(probs, shift_at(probs, 1), case.n, ALPHA, battery_keys(probs))
    assert power >= 0.9, power


def check_exact(case: Case, monkeypatch) -> None:
    probs = case.exact()
    s = sample(case, case.n, 10_000, monkeypatch)
    assert min(s.rejected) >= MIN_REJECTIONS, s.rejected  # rejections at positions 1, 2 and 3
    if isinstance(case.drafter, HotDraftModel) and not case.drafter.masked:  # chains cut after 1 and 2
        assert s.cut[1] >= MIN_REJECTIONS and s.cut[2] >= MIN_REJECTIONS, s.cut
    elif case.constraint is not None:
        assert not s.cut  # a chain drawn under the mask stays inside the language
    if case.prefix_cache:
        assert s.cached == case.n - 1  # every draw after the first restored the prompt
    if case.drafter == "draft" and case.constraint is None:
        # position 1 of the first verify is accepted with probability sum_x min(p(x), q(x))
        x = mx.array(case.prompt)[None]
        p, q = (np.exp(np.array(case.params.logprobs(m(x)[0, -1:]), dtype=np.float64))[0]
                for m in (case.target, case.draft_model))
        theory = float(np.minimum(p, q).sum())
        assert 0.1 < theory < 0.95  # neither useless nor a copy
        rate = s.first_accepted / case.n
        assert abs(rate - theory) < 4 * (theory * (1 - theory) / case.n) ** 0.5, (rate, theory)
    pvalues = battery_pvalues(s.counts, probs, case.n, battery_keys(probs))
    assert min(pvalues.values()) > ALPHA / len(pvalues), pvalues


def check_planted(case: Case, monkeypatch) -> None:
    probs = case.exact()
    s = sample(case, case.n_planted, 90_000, monkeypatch, planted=case.planted)
    pvalues = battery_pvalues(s.counts, probs, case.n_planted, battery_keys(probs))
    assert min(pvalues.values()) < PLANTED_P, (case.planted, pvalues)


# -- the tests --------------------------------------------------------------------------------------

def test_the_test_has_power(case):
    check_power(case)


@pytest.mark.slow
def test_sampling_is_exact_at_every_position(case, monkeypatch):
    check_exact(case, monkeypatch)


@pytest.mark.slow
def test_a_wrong_rule_at_position_2_is_caught(case, monkeypatch):
    check_planted(case, monkeypatch)


# -- plain sampling -------------------------------------------------------------------------------

def test_processing_matches_mlx_lm_sampler():
    """Our processed distribution is the one mlx-lm's own sampler draws from."""
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=6, min_p=0.02)
    mx.random.seed(7)
    logits = mx.random.normal((1, 10)) * 2.0
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    n = 6000
    counts = Counter(sampler(lp).item() for _ in range(n))
    probs = {i: float(x) for i, x in enumerate(np.exp(np.array(params.logprobs(logits)[0])))}
    assert chi_square_p(counts, probs, n) > ALPHA


def test_exact_joint_is_the_chain_of_plain_rows(models):
    """exact_joint (batched) gives each sequence the product of plain decoding's rows."""
    target, _ = models.vocab8
    params = SamplingParams(temperature=0.7, top_p=0.95, min_p=0.02)
    probs = exact_joint(target, [2, 3, 2], 2, params)
    assert abs(sum(probs.values()) - 1) < 1e-6
    for seq in [(0, 0), max(probs, key=probs.get), min(probs, key=probs.get)]:
        want = 1.0
        for i, tok in enumerate(seq):
            row = params.logprobs(target(mx.array([2, 3, 2, *seq[:i]])[None])[0, -1:])
            want *= float(np.exp(np.array(row, dtype=np.float64))[0, tok])
        assert abs(probs.get(seq, 0.0) - want) < 1e-6 * max(want, 1e-3), seq


def test_seeded_runs_are_reproducible(models):
    target, draft = models.vocab8
    dec = SpeculativeDecoder(target, draft_model=draft, drafter="draft")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=6, min_p=0.02)

    def run():
        return [t for toks, _ in dec.generate([2, 3, 2, 3, 2], sampling=params, max_tokens=30, seed=123)
                for t in toks]

    assert run() == run()
