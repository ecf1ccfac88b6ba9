"""Gates and depth: speculation steps aside when it does not pay and comes back when it does."""

import random

import mlx_lm
import pytest

import tiny
from mlxspec.engine.drafters.pld import PromptLookupDrafter, repetition_score
from mlxspec.engine.gates import AcceptanceModel, CostModel, ShadowDrafts, SpeculationGate
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.speculate import SpeculativeDecoder

NOVEL_PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    return mlx_lm.load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def looping_llama(tmp_path_factory, shared_tokenizer):
    """Small weights: greedy output falls into loops, as real models do when echoing text."""
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("looping"), "llama",
                                 tokenizer=shared_tokenizer, seed=0, weight_scale=0.05)
    return mlx_lm.load(str(path))


def run(model, prompt, n=80, **kw):
    dec = SpeculativeDecoder(model, **kw)
    out, stats = [], None
    for toks, stats in dec.generate(prompt, max_tokens=n):
        out.extend(toks)
    return out, stats


def test_draft_equal_to_target_is_always_accepted(qwen3):
    model, tok = qwen3
    prompt = tok.encode(NOVEL_PROMPT)
    # gates off: a draft as large as the target never pays, and the gate knows it
    _, stats = run(model, prompt, drafter="draft", draft_model=model, depth=4, gates=False)
    assert stats.acceptance == 1.0
    assert stats.mean_accepted_length == pytest.approx(5.0, abs=0.5)
    dec = SpeculativeDecoder(model, drafter="draft", draft_model=model, depth=4, gates=False)
    for _, stats in dec.generate(prompt, sampling=SamplingParams(temperature=0.8), max_tokens=60, seed=3):
        pass
    assert stats.acceptance > 0.98


def test_useless_draft_model_is_switched_off(qwen3, tiny_qwen3_draft):
    model, tok = qwen3
    draft = mlx_lm.load(str(tiny_qwen3_draft))[0]
    prompt = tok.encode(NOVEL_PROMPT)
    plain, _ = run(model, prompt, n=200, drafter="none")
    out, stats = run(model, prompt, n=200, drafter="draft", draft_model=draft)
    assert out == plain
    assert stats.acceptance < 0.2
    off = [e for e in stats.gate_events if not e.enabled]
    # on trial, its proposals were checked against plain tokens: not one verify was spent
    assert off and "trial proposals" in off[0].reason and off[0].at_token <= 4
    assert stats.verify_steps == 0 and stats.plain_steps == 200
    # after switching off it only probes now and then, with growing gaps (16, 32, 64 tokens)
    assert 4 <= stats.probes <= 8


def _plain_starts(monkeypatch) -> list[bool]:
    """Per plain step of the loop: whether it found nothing queued (the pipeline had stopped)."""
    from mlxspec.engine import speculate

    starts = []
    real = speculate._Run._pipelined_token

    def spy(self, pending, remaining):
        starts.append(pending is None)
        return real(self, pending, remaining)

    monkeypatch.setattr(speculate._Run, "_pipelined_token", spy)
    return starts


def test_probes_run_beside_the_queued_plain_step(qwen3, tiny_qwen3_draft, monkeypatch):
    """A switched-off draft model's probes go into the GPU queue behind the plain step in flight
    and are read when the tokens they guessed are: the plain steps stay pipelined through them,
    the trial's too. Only the first step and the one after the trial is decided (``depth()``
    ends it) find nothing queued. Planted: probing as before (a due probe stops the pipeline,
    then runs alone, and every trial step runs alone) adds one such step per probe."""
    model, tok = qwen3
    draft = mlx_lm.load(str(tiny_qwen3_draft))[0]
    prompt = tok.encode(NOVEL_PROMPT)
    plain, _ = run(model, prompt, n=200, drafter="none")
    starts = _plain_starts(monkeypatch)
    out, stats = run(model, prompt, n=200, drafter="draft", draft_model=draft)
    assert out == plain and stats.verify_steps == 0 and stats.probes >= 6
    trial = stats.gate_events[0].at_token
    assert trial >= 3 and sum(starts) <= 2, (sum(starts), trial, stats.probes)

    starts.clear()  # planted: probed as a drafter that cannot probe in flight is (before, all of them)
    from mlxspec.engine.drafters.draft_model import DraftModelDrafter

    monkeypatch.setattr(DraftModelDrafter, "probes_in_flight", False)
    out, stats = run(model, prompt, n=200, drafter="draft", draft_model=draft)
    assert out == plain and sum(starts) >= trial + 1 + (stats.probes - trial)


def test_probes_take_no_random_draw(qwen3, tiny_qwen3_draft):
    """A drafter the gate keeps off changes nothing of a seeded sampled run: its probes are
    greedy and never verified, so the request's draws are plain decoding's, one per token."""
    model, tok = qwen3
    draft = mlx_lm.load(str(tiny_qwen3_draft))[0]
    prompt = tok.encode(NOVEL_PROMPT)
    sampling = SamplingParams(temperature=0.9)
    runs = []
    for kw in (dict(drafter="none"), dict(drafter="draft", draft_model=draft)):
        out, stats = [], None
        for toks, stats in SpeculativeDecoder(model, **kw).generate(prompt, sampling=sampling, max_tokens=120,
                                                                     seed=11):
            out.extend(toks)
        runs.append((out, stats))
    (plain, _), (probed, stats) = runs
    assert stats.verify_steps == 0 and stats.probes >= 4
    assert probed == plain


def test_a_drafter_that_agrees_leaves_its_trial_at_once(qwen3):
    model, tok = qwen3
    _, stats = run(model, tok.encode(NOVEL_PROMPT), n=40, drafter="draft", draft_model=model,
                   cost=CostModel(slope=0.08))
    # one trial proposal agreed: it speculated from the next step (a draft as large as the
    # target may be switched off later for its cost, not for its drafts)
    assert stats.probes >= 1 and stats.acceptance == 1.0 and stats.verify_steps >= 3
    assert all(e.at_token >= 8 for e in stats.gate_events)


def test_prompt_gate_keeps_lookup_off_for_novel_prompts(qwen3):
    model, tok = qwen3
    _, stats = run(model, tok.encode(NOVEL_PROMPT), n=10, drafter="pld")
    assert stats.gate_events and not stats.gate_events[0].enabled
    assert "prompt repetition score" in stats.gate_events[0].reason


def test_lookup_reengages_when_output_repeats(looping_llama):
    model, tok = looping_llama
    prompt = tok.encode(NOVEL_PROMPT)
    plain, _ = run(model, prompt, n=120, drafter="none")
    # a GPU-like cost curve, so the decision does not depend on the machine running the test
    out, stats = run(model, prompt, n=120, drafter="pld", cost=CostModel(slope=0.08))
    assert out == plain
    events = [(e.enabled, e.reason) for e in stats.gate_events]
    assert events[0][0] is False
    assert any(on and "pay again" in reason for on, reason in events), events
    assert stats.accepted > 20
    # fewer target forwards than tokens (plain decoding needs exactly one per token)
    assert stats.generated_tokens / (stats.verify_steps + stats.plain_steps) > 1.1


def test_gates_off_forces_speculation(qwen3, tiny_qwen3_draft):
    model, tok = qwen3
    draft = mlx_lm.load(str(tiny_qwen3_draft))[0]
    _, stats = run(model, tok.encode(NOVEL_PROMPT), n=40, drafter="draft", draft_model=draft, depth=2, gates=False)
    assert not stats.gate_events
    assert stats.verify_steps >= 13


# -- units ------------------------------------------------------------------------------

class _FakeDrafter:
    name, cost_per_token, uses_model = "fake", 0.0, False


def test_depth_follows_acceptance():
    gate = SpeculationGate(_FakeDrafter(), max_depth=8, cost=CostModel(slope=0.1))
    for _ in range(40):
        gate.observe(8, 8)
    assert gate.depth() == 8
    for i in range(40):  # the first position accepted one time in three: short drafts, or none
        gate.observe(4, 1 if i % 3 == 0 else 0)
    assert gate.depth() <= 2


def test_gate_hysteresis_and_events():
    gate = SpeculationGate(_FakeDrafter(), max_depth=4, cost=CostModel(slope=0.5))
    for _ in range(30):
        gate.observe(4, 0)
    assert gate.depth() == 0 and not gate.on
    assert gate.events[-1][0] is False
    for _ in range(30):
        gate.observe(4, 4)
    assert gate.depth() > 0 and gate.on
    assert gate.events[-1][0] is True


def test_the_gate_weighs_a_verify_against_a_pipelined_plain_token():
    """A plain token costs CostModel.plain waited forwards (pipelined: the next forward queued
    while the host reads one). Drafts whose first token is always kept and second never pay
    2 tokens for a verify of 1.2: 1.67x against a waited forward, 0.83x against a plain token
    at half of one; that gate switches off. Planted bug, the factor ignored: it stays on."""
    curve = {1: 1.0, 2: 1.2, 3: 1.4}
    for plain, on in ((1.0, True), (0.5, False)):
        gate = SpeculationGate(_FakeDrafter(), max_depth=2, cost=CostModel(curve=curve, plain=plain))
        for _ in range(SpeculationGate.MIN_EVIDENCE + 4):
            gate.observe(2, 1)
        assert gate.speedup(1) == pytest.approx(1.67 * plain, rel=0.05)
        gate.depth()
        assert gate.on is on, plain


def test_the_pipelined_plain_token_is_measured_and_stored(tmp_path, monkeypatch, tiny_qwen3):
    """measure_verify_cost times plain decoding as mlx-lm's loop runs it and keeps it beside the
    curve, in [0.25, 1] of a waited forward; the stored record carries it (an older record or
    a bad value reads as 1)."""
    import json

    from mlxspec.api import load
    from mlxspec.engine import costs
    from mlxspec.tuning import storage

    model = mlx_lm.load(str(tiny_qwen3))[0]
    cost = costs.measure_verify_cost(model, widths=(1, 2), reps=2, context=16)
    assert 0.25 <= cost.plain <= 1.0
    monkeypatch.setattr(costs, "PLAIN_MAX_S", 0.0)  # a machine too slow for it: not measured
    assert costs.measure_verify_cost(model, widths=(1, 2), reps=1, context=16, budget_s=5.0).plain == 1.0

    monkeypatch.setenv(storage.DATA_ENV, str(tmp_path / "tune"))
    spec = load(str(tiny_qwen3))
    storage.save_cost(spec.target, CostModel(curve={1: 1.0, 2: 1.3}, measured=True, plain=0.7))
    path = storage.result_path(spec.target)
    record = json.loads(path.read_text())
    assert record["plain_step"] == 0.7 and storage.stored_cost(spec.target).plain == 0.7
    for bad in (3, 0, "x", True, None):
        path.write_text(json.dumps({**record, "plain_step": bad}))
        assert storage.stored_cost(spec.target).plain == 1.0, bad


def test_expected_tokens():
    model = AcceptanceModel(3, prior=0.5, prior_weight=1e-9)
    for _ in range(100):
        model.observe(3, 3)
    assert model.expected_tokens(3) == pytest.approx(4.0, rel=1e-3)


def test_repetition_score():
    assert repetition_score(list(range(100))) == 0.0
    assert repetition_score([1, 2, 3] * 30) > 0.9


def _brute_lookup(tokens, k, max_n, min_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence
            if tokens[start : start + n] == suffix:
                seq = list(tokens)  # copy forward, continuing into what was copied
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[len(tokens):]
    return []


def test_lookup_index_matches_brute_force():
    rng = random.Random(1)
    drafter = PromptLookupDrafter(max_ngram=4, min_ngram=2)
    tokens = [rng.randrange(6) for _ in range(20)]
    drafter.start(tokens)
    for _ in range(300):
        assert drafter.lookup(tokens, 5) == _brute_lookup(tokens, 5, 4, 2)
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def _walk_index(tokens: list[int], max_ngram: int, min_ngram: int, paths: int):
    """The lookup index as a walk over every end position and n builds it: (latest end of each
    n-gram, up to PATHS earlier ends, oldest first)."""
    index, earlier = {}, {}
    for i in range(len(tokens) - 1):
        for n in range(min_ngram, max_ngram + 1):
            if i + 1 >= n:
                gram = tuple(tokens[i + 1 - n : i + 1])
                if gram in index:
                    earlier[gram] = (earlier.get(gram, []) + [index[gram]])[-paths:]
                index[gram] = i
    return index, earlier


@pytest.mark.parametrize("vocab", [3, 40, 5000])
def test_lookup_index_in_spans_equals_the_walk(vocab):
    """Caught up in spans of any size (a prompt's prefill chunks, then 1-9 tokens a step), the
    index and its earlier ends are exactly the walk's, whatever repeats."""
    rng = random.Random(vocab)
    d = PromptLookupDrafter(max_ngram=4, min_ngram=1)
    tokens = [rng.randrange(vocab) for _ in range(700)]
    d.start(tokens)
    for upto in (1, 2, 300, 301, 700):  # prefill chunks
        d.prefill(tokens, upto)
    assert d._indexed == 699
    for _ in range(60):
        tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 10)))
        d.lookup(tokens, 3)
        assert (d._index, d._earlier) == _walk_index(tokens, 4, 1, d.PATHS)
        assert d._indexed == len(tokens) - 1


def test_the_prompt_is_indexed_during_prefill_not_in_the_first_step(looping_llama, monkeypatch):
    """A long prompt's n-grams go into the lookup index chunk by chunk as the target prefills
    it; a decoding step then indexes only the tokens committed since (at 32K tokens the first
    step waited about 40 ms for the whole prompt)."""
    model, _ = looping_llama
    prompt = [(7 * i) % 97 + 3 for i in range(300)]
    drafter = PromptLookupDrafter()
    spans = []  # (tokens seen, positions this call indexes)
    walk = PromptLookupDrafter._catch_up

    def recorded(self, tokens):
        spans.append((len(tokens), max(0, len(tokens) - 1 - self._indexed)))
        walk(self, tokens)

    monkeypatch.setattr(PromptLookupDrafter, "_catch_up", recorded)
    for _ in SpeculativeDecoder(model, drafter=drafter, depth=4, gates=False).generate(
            prompt, max_tokens=20, prefill_step=64):
        pass
    during_prefill = [n for seen, n in spans if seen < len(prompt)]
    assert len(during_prefill) >= 4 and sum(during_prefill) == len(prompt) - 2
    assert max(n for seen, n in spans if seen > len(prompt)) <= 5  # at most a step's tokens


def test_lookup_prefers_longest_then_most_recent():
    d = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    tokens = [1, 2, 3, 9, 9, 5, 3, 7, 7, 1, 2, 3]
    d.start(tokens)
    assert d.lookup(tokens, 2) == [9, 9]  # "1 2 3" beats the more recent "3"
    tokens2 = [4, 3, 8, 4, 3, 6, 4, 3]
    d.start(tokens2)
    assert d.lookup(tokens2, 1) == [6]  # the most recent "4 3"
    run = [5, 1, 2, 1, 2]
    d.start(run)
    assert d.lookup(run, 5) == [1, 2, 1, 2, 1]  # a periodic tail proposes a full-length draft


H100_CURVE = {1: 1.0, 2: 1.096, 3: 1.134, 4: 1.149, 5: 1.209, 6: 1.204, 7: 1.271, 8: 1.32, 9: 1.412}


def _echo_gate(early: bool = True, fixed_depth: int | None = None):
    """Prompt lookup gated off by a novel prompt (the 8B shape's H100 costs), then the output
    copies a span of the prompt: (gate, shadow, tokens, span)."""
    d = PromptLookupDrafter()
    gate = SpeculationGate(d, 8, cost=CostModel(curve=H100_CURVE, plain=0.742, measured=True), fixed_depth=fixed_depth)
    if not early:
        gate.decided_early = lambda pending: False
    span = list(range(100, 140))
    tokens = list(range(1, 40)) + span + list(range(40, 60))
    d.start(tokens)
    gate.prompt_check(repetition_score(tokens))
    return gate, ShadowDrafts(d, 8), tokens, span


def _tokens_until_on(early: bool) -> int:
    gate, shadow, tokens, span = _echo_gate(early)
    assert gate.depth() == 0
    for n, t in enumerate(span, start=1):
        tokens.append(t)
        gate.after_plain(shadow, tokens)
        if gate.depth():
            return n
    raise AssertionError("never switched on")


def test_a_shadow_proposal_switches_lookup_on_once_a_miss_could_not_stop_it():
    """Copying a span: the first shadow proposal (8 tokens, after the 2-gram that starts it)
    switches drafting on after 2 of its tokens matched, where settling it whole took all 8."""
    assert _tokens_until_on(early=True) == 2 + 2
    assert _tokens_until_on(early=False) == 2 + 8


@pytest.mark.parametrize("fixed_depth", [None, 8])
@pytest.mark.parametrize("matched", range(1, 8))
def test_deciding_early_never_switches_on_where_the_whole_proposal_would_not(matched, fixed_depth):
    """If the gate decides early after MATCHED tokens of 8, a miss at the next one (the worst
    the rest of the proposal can do) must still switch it on; and it decides early whenever
    that is so (the two bounds of the rule). A depth the user fixed is the only one weighed."""
    gate, shadow, tokens, span = _echo_gate(fixed_depth=fixed_depth)
    decided = gate.decided_early((8, matched))
    worst, _, _, _ = _echo_gate(fixed_depth=fixed_depth)
    worst.observe(8, matched)
    assert decided == (worst.depth() > 0)
    assert (gate.depth() > 0) == decided  # deciding early is recording the matched tokens


def test_deciding_early_weighs_only_the_depth_the_user_fixed():
    """A 2-token verify costs what a plain token does, a 3-token one three: at the fixed depth
    2 drafting never pays, so no proposal decides early, though depth 1 would pay."""
    d = PromptLookupDrafter()
    gate = SpeculationGate(d, 2, cost=CostModel(curve={1: 1.0, 2: 1.0, 3: 3.0}, measured=True), fixed_depth=2)
    gate.prompt_check(0.0)
    assert not gate.decided_early((8, 7))
    assert gate.depth() == 0


def test_cost_curve_interpolates_measured_widths():
    cost = CostModel(slope=0.5, curve={1: 1.0, 4: 2.5, 8: 1.9})
    assert cost.verify(4) == 2.5
    assert cost.verify(6) == pytest.approx(2.5 + (1.9 - 2.5) * 2 / 4)
    assert cost.verify(10) == pytest.approx(1.9 + 0.5 * 2)
    # a cheap 8-wide verify makes 7 drafts better than 5 at equal acceptance
    gate = SpeculationGate(_FakeDrafter(), max_depth=7, cost=CostModel(curve={1: 1.0, 6: 3.1, 8: 1.8}))
    for _ in range(40):
        gate.observe(8, 8)
    assert gate.depth() == 7


def test_measured_cost_only_without_seed(tiny_qwen3):
    import mlxspec
    from mlxspec.engine.costs import measure_verify_cost

    curve = measure_verify_cost(mlx_lm.load(str(tiny_qwen3))[0], widths=(1, 2, 4), reps=1)
    assert curve.measured and set(curve.curve) == {1, 2, 4} and curve.curve[1] == 1.0
    m = mlxspec.load(str(tiny_qwen3))
    assert m.generate("hi", max_tokens=3, temperature=0.5, seed=1).stats.cost_model == "default"
    assert m.generate("hi", max_tokens=3).stats.cost_model == "measured"


def test_verify_widths_are_timed_in_interleaved_rounds(monkeypatch):
    """A slow stretch of the host must fall on every width alike: the reps come in rounds of
    every width (forwards, then backwards), and each forward keeps one token so the cache
    grows as in generation."""
    from mlxspec.engine import costs

    class State:
        def __init__(self, model):
            self.length, self.calls = 0, []
            states.append(self)

        def prefill(self, tokens):
            self.length = len(tokens)

        def forward(self, tokens):
            self.calls.append((tokens.size, self.length))
            self.length += tokens.size
            return tokens

        def rollback_to(self, n):
            self.length = n

        def commit(self):
            pass

    states = []
    monkeypatch.setattr(costs, "ModelState", State)
    times = costs.verify_times(None, widths=(2, 4), context=10, reps=3, warmup_each=True)
    calls = states[0].calls
    assert [n for n, _ in calls] == [1, 1, 2, 4] + [1, 2, 4, 4, 2, 1, 1, 2, 4]
    assert [at for _, at in calls] == list(range(10, 10 + len(calls)))
    assert {n: len(t) for n, t in times.items()} == {1: 3, 2: 3, 4: 3}


def test_a_drafter_that_is_never_right_is_switched_off_after_three_steps():
    """A model drafter starts on trial: proposals checked against plain tokens, no verify.
    Nothing accepted: off after 3 trial proposals and no verify; one accepted at once:
    speculation starts and the usual 8 steps of evidence decide."""
    from mlxspec.engine.gates import CostModel, SpeculationGate

    class Head(PromptLookupDrafter):
        uses_model = True
        cost_per_token = 0.05

    flat = CostModel(curve={n: 1.0 + 0.3 * (n - 1) for n in range(1, 10)}, measured=True)  # 27B-like
    for first_accepted, probes_then, verifies_then in ((0, 3, 0), (1, 1, 7)):
        gate = SpeculationGate(Head(), 4, flat)
        probes = verifies = 0
        while probes + verifies < 20:
            k = gate.depth()
            if k == 0:
                if not gate.trial:
                    break
                assert gate.probe_depth() == 1 and gate.shadowing and gate.would_draft()
                gate.observe(1, first_accepted if probes == 0 else 0)
                probes += 1
            else:
                gate.observe(k, 0)
                verifies += 1
        assert not gate.on and (probes, verifies) == (probes_then, verifies_then), (first_accepted, probes, verifies)
        assert gate.probe_depth() == 0  # off: the next probe waits 16 plain tokens
        for _ in range(16):
            gate.tick_plain()
        assert gate.would_draft() and gate.depth() == 0 and gate.probe_depth() == 1
        assert gate.probe_depth() == 0  # and the one after it 32
