"""Batched decoding (engine/batch.py): every row is its request served alone.

- Identity: on mini-attn and mini-hybrid (GatedDeltaNet) in fp32, requests join at random
  steps and random ones are cancelled; each request that completes gives exactly the tokens
  it gives alone: at temperature 0, and at temperature > 0 with a seed (the row draws from
  its own stream in the order the single-request loop does). Planted bugs fail it: the ragged rollback applying only the
  rows' common junk; every row's recurrent state replayed by the first row's kept count.
- Distribution: prompt lookup at temperature 0.35 (test_distribution's pld case: drafts
  rejected at positions 1, 2 and 3, counted) drawn as batch rows beside neighbours at
  temperature 0.25 (another prompt, another length) and 0: each row kind scored against its
  own exact distribution by the same battery, whose power (>= 0.9 against 3 points moved at
  position 2) is checked beside it. The 0.35 rows are unseeded and draft 1 token of their
  own, so they draft position 2 (and 3) only into the pads a neighbour's deeper draft leaves
  (engine/batch_step.py). Planted: one sampler for the whole batch (the first row's
  temperature for every row, as mlx-vlm's batched speculation does) fails it.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

import mlxspec
from mlxspec.engine import batch as batch_mod
from mlxspec.engine import batch_cache, batch_step
from mlxspec.engine.batch import BatchedDecoder, RowPlan
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.sampling import SamplingParams, accept
from mlxspec.errors import UsageError
from mlxspec.models.dflash import DFlashDraftModel
from mlxspec.options import ConstraintSpec
from stats_helpers import battery_keys, battery_pvalues, exact_joint, shift_at, simulated_power
from stream_helpers import drain, random_schedule

MODELS = Path(__file__).resolve().parent.parent / "benchmarks" / "models"

IMPORTS = "import os\nimport sys\nimport os\nimport"
LISTS = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"
REVERSE = "Write a function that reverses a string."
REQUESTS = [  # (prompt, options): every batched drafter, temperature 0 and seeded > 0, several lengths
    (IMPORTS, dict(drafter="pld", max_tokens=40)),
    (REVERSE, dict(drafter="none", max_tokens=25)),
    (REVERSE, dict(drafter="pld", temperature=0.8, seed=3, max_tokens=36)),
    ("List three colors.", dict(drafter="pld", temperature=1.0, top_p=0.9, seed=5, max_tokens=30)),
    (LISTS, dict(drafter="pld", temperature=0.5, top_k=20, seed=8, max_tokens=28)),
    ("Say hi.", dict(drafter="none", temperature=0.7, seed=11, max_tokens=12)),
    (LISTS, dict(drafter="pld", max_tokens=40)),
    (IMPORTS, dict(drafter="mtp", max_tokens=40)),  # the MTP head reads its row's hidden states
    (LISTS, dict(drafter="mtp", temperature=0.8, seed=13, max_tokens=30)),
    (REVERSE, dict(drafter="draft", temperature=0.6, seed=17, max_tokens=30)),  # mini-attn's draft only
    # rows that read their rows: a constraint's masks (drafts cut), penalties and bias, logprobs
    (REVERSE, dict(drafter="pld", constraint=ConstraintSpec("regex", "[a-z ]{4,40}\\."), max_tokens=24)),
    (IMPORTS, dict(drafter="mtp", temperature=0.7, seed=23, repetition_penalty=1.3, presence_penalty=0.5,
                   max_tokens=30)),
    (LISTS, dict(drafter="pld", logprobs=3, max_tokens=25)),
    (IMPORTS, dict(drafter="pld", temperature=0.9, seed=29, logit_bias={198: 2.0}, max_tokens=30)),
]


@pytest.fixture(scope="module")
def spec():
    s = mlxspec.load(str(MODELS / "mini-attn"), draft_model=str(MODELS / "mini-draft"))
    s.astype("float32")
    return s


@pytest.fixture(scope="module")
def alone(spec):
    return [spec.generate(p, reuse=False, **o).tokens for p, o in REQUESTS]


@pytest.fixture(scope="module")
def hybrid():
    """mini-hybrid: GatedDeltaNet layers, each row's recurrent state replayed by its own count
    (it has no draft model: its requests are the others)."""
    s = mlxspec.load(str(MODELS / "mini-hybrid"))
    s.astype("float32")
    return s, [None if o["drafter"] == "draft" else s.generate(p, reuse=False, **o).tokens for p, o in REQUESTS]


def common_junk_only(self, junk):
    """PLANTED: every row rolled back by the junk all rows share (a uniform trim)."""
    for layer in self.layers:
        layer.trim(min(junk))


def run_schedule(spec, seed: int, alone: list, max_rows: int = 4, requests: int = 12):
    """REQUESTS requests join at random steps, a few are cancelled; returns (finished: index ->
    tokens, cancelled count, the most rows decoded together)."""
    rng = random.Random(seed)
    batch = spec.batch(max_rows)
    queue = [i for i in (rng.randrange(len(REQUESTS)) for _ in range(requests)) if alone[i] is not None]
    return random_schedule(
        batch, queue, lambda i: spec.stream_in(batch, REQUESTS[i][0], reuse=False, **REQUESTS[i][1]), rng, 0.4,
        # the client leaves: now and then, and at least once a schedule (after two finished)
        lambda finished, cancelled: rng.random() < 0.01 or (not cancelled and len(finished) >= 2))


@pytest.mark.parametrize("target", ["attn", "hybrid"])
def test_rows_give_what_each_request_gives_alone(target, request, monkeypatch):
    spec, alone = (request.getfixturevalue("spec"), request.getfixturevalue("alone")) if target == "attn" \
        else request.getfixturevalue("hybrid")
    junks = []
    real = batch_cache.RaggedCache.rollback
    monkeypatch.setattr(batch_cache.RaggedCache, "rollback", lambda self, junk: (junks.append(junk), real(self, junk)))
    done, cancelled, most = 0, 0, 0
    for seed in range(2):
        finished, c, m = run_schedule(spec, seed, alone, requests=9)
        for i, got in finished:
            assert got == alone[i], (seed, i)
        done, cancelled, most = done + len(finished), cancelled + c, max(most, m)
    assert done >= 10 and cancelled >= 1 and most >= 3, (done, cancelled, most)
    # rows were rolled back by different amounts in one step (drafts rejected at different places)
    assert sum(len(set(j)) > 1 for j in junks) >= 15, junks


GREEDY = [0, 1, 6, 7]  # REQUESTS at temperature 0 with nothing reading their rows: pld, none, pld, mtp


def run_together(spec, which: list[int]) -> list[list[int]]:
    """REQUESTS[i] for i in WHICH, all in one batch from the start; each one's tokens."""
    batch = spec.batch(len(which))
    return drain(spec.stream_in(batch, REQUESTS[i][0], reuse=False, **REQUESTS[i][1]) for i in which)


def test_greedy_rows_are_decided_together_as_alone(spec, alone, monkeypatch):
    """Every row greedy with nothing reading its rows: one argmax and one read for the batch
    (batch.greedy_accept, verifies of different draft lengths and queued plain steps)."""
    widths = []
    real = batch_mod.greedy_accept
    monkeypatch.setattr(batch_mod, "greedy_accept",
                        lambda logits, drafts: (widths.append(sorted(len(d) for d in drafts)), real(logits, drafts))[1])
    assert run_together(spec, GREEDY) == [alone[i] for i in GREEDY]
    assert sum(w[0] != w[-1] for w in widths) >= 5, widths  # rows with drafts of different lengths


def test_the_planted_greedy_accept_past_a_short_draft_is_caught(spec, alone, monkeypatch):
    """PLANTED: a row's pad positions after its shorter draft count as matches."""
    def planted(logits, drafts):
        b, w = logits.shape[:2]
        tokens = batch_mod.greedy_tokens(logits)
        if w == 1:
            return mx.zeros((b,), mx.int32), tokens
        mine = tokens[:, :-1].astype(mx.int32)
        padded = mx.array([list(d) + [-1] * (w - 1 - len(d)) for d in drafts], mx.int32)
        same = (mine == padded) | (padded < 0)
        return mx.cumprod(same.astype(mx.int32), axis=1).sum(axis=1), tokens

    monkeypatch.setattr(batch_mod, "greedy_accept", planted)
    got = run_together(spec, GREEDY)
    assert sum(g != alone[i] for g, i in zip(got, GREEDY)) >= 2


class Oracle(PromptLookupDrafter):
    """A host drafter that proposes SCRIPT from each position, wrong at every 23rd, at no cost
    (so most verifies keep every draft and the next verify can be guessed and queued)."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.script = script

    def _from(self, start: int, k: int) -> list[int]:
        at = lambda p: (self.script[p] if p < len(self.script) else 0) + (p % 23 == 0)  # noqa: E731
        return [at(p) for p in range(start, start + k)] if k > 0 else []

    def lookup(self, tokens, k):
        return self._from(len(tokens), k)

    def peek(self, tokens, extra, k):
        return self._from(len(tokens) + len(extra), k)


def oracle_rows(spec, which: list[int]) -> list[tuple]:
    """(prompt ids, sampling, seed, script) of REQUESTS[i] for i in WHICH: the script is the
    request's greedy output (alone), which seeded rows follow less often."""
    rows = []
    for i in which:
        prompt, o = REQUESTS[i]
        ids = spec.encode(prompt)
        greedy = spec.generate(ids, reuse=False, max_tokens=o["max_tokens"]).tokens
        rows.append((ids, SamplingParams(o.get("temperature", 0.0), o.get("top_p", 1.0), o.get("top_k", 0)),
                     o.get("seed"), ids + greedy, o["max_tokens"]))
    return rows


def run_oracle_batch(spec, rows) -> tuple[list[list[int]], list]:
    """The rows (oracle_rows) decoded together at depth 3, gates off; their tokens and stats."""
    batch = BatchedDecoder(spec.target.model, len(rows))
    added = [batch.add(ids, sampling=s, max_tokens=n, stop_tokens=set(), seed=seed,
                       plan=RowPlan(Oracle(script), 3, 3, gates=False)) for ids, s, seed, script, n in rows]
    return drain((r.updates() for r in added), lambda item: item[0]), [r.stats for r in added]


def oracle_alone(spec, row) -> list[int]:
    from mlxspec.engine.speculate import SpeculativeDecoder

    ids, s, seed, script, n = row
    dec = SpeculativeDecoder(spec.target.model, drafter=Oracle(script), depth=3, gates=False)
    return [t for new, _ in dec.generate(ids, sampling=s, max_tokens=n, seed=seed) for t in new]


AHEAD = [0, 6, 2, 4]  # no rules: greedy rows and seeded > 0 rows


@pytest.fixture(scope="module")
def oracles(spec):
    """AHEAD's oracle rows and each one's tokens alone (the single-request loop, same drafter)."""
    rows = oracle_rows(spec, AHEAD)
    return rows, [oracle_alone(spec, row) for row in rows]


def test_queued_verifies_keep_every_row_as_alone(spec, oracles, monkeypatch):
    """Every verify's successor queued whatever the hit rate (batch_ahead.py): the hits are used,
    the misses rolled back from every row; each row's tokens stay its tokens alone. A guess is
    all or nothing for the batch: one row a batch (a request alone, the case it is for), then
    two greedy rows together."""
    from mlxspec.engine import batch_ahead

    monkeypatch.setattr(batch_ahead.AheadGate, "ON_AT", 0.0)
    rows, want = oracles
    used = dropped = 0
    for row, mine in zip(rows, want):
        got, stats = run_oracle_batch(spec, [row])
        assert got == [mine]
        used, dropped = used + stats[0].queued_used, dropped + stats[0].queued_dropped
    assert used >= 10 and dropped >= 5, (used, dropped)
    got, stats = run_oracle_batch(spec, rows[:2])
    assert got == want[:2] and sum(s.queued_used for s in stats) >= 4


def test_the_planted_queued_verify_taken_unchecked_is_caught(spec, oracles, monkeypatch):
    """PLANTED: the queued forward is used without checking the verify it guessed (every draft
    kept, the target's token) nor that the next plan is the guess."""
    from mlxspec.engine import batch_ahead

    monkeypatch.setattr(batch_ahead.AheadGate, "ON_AT", 0.0)

    def planted(self, rows, plans, width):
        g, self.guess = self.guess, None
        if g is None or g.logits is None:
            return None
        if g.width == width and g.rows == list(rows):
            return g.logits
        self.cache.rollback([g.width] * len(g.rows))
        return None

    rows, want = oracles
    monkeypatch.setattr(batch_ahead.BatchAhead, "settle", planted)
    monkeypatch.setattr(batch_ahead.BatchAhead, "confirmed", lambda self, plans, kept, last: 0)
    got = [run_oracle_batch(spec, [row])[0][0] for row in rows[:2]]
    assert sum(g != w for g, w in zip(got, want)) >= 1


def test_the_planted_uniform_rollback_is_caught(spec, alone, monkeypatch):
    monkeypatch.setattr(batch_cache.RaggedCache, "rollback", common_junk_only)
    finished, _, _ = run_schedule(spec, 0, alone, requests=7)
    assert sum(got != alone[i] for i, got in finished) >= 2


def test_plain_rows_queue_each_next_step(spec, monkeypatch):
    """Rows that all decode plainly (no drafter) queue each next step behind the last, as the
    single-request loop does (a count that does not hang on measured costs); tokens as alone."""
    requests = [(REVERSE, dict(drafter="none", max_tokens=20)), (LISTS, dict(drafter="none", max_tokens=16)),
                ("Say hi.", dict(drafter="none", temperature=0.7, seed=11, max_tokens=14))]
    want = [spec.generate(p, reuse=False, **o).tokens for p, o in requests]
    queued = []
    real = BatchedDecoder._queue_plain

    def spy(self, rows, tokens, pipelined):
        real(self, rows, tokens, pipelined)
        queued.append(self._queued is not None)

    monkeypatch.setattr(BatchedDecoder, "_queue_plain", spy)
    batch = spec.batch(3)
    assert drain(spec.stream_in(batch, p, reuse=False, **o) for p, o in requests) == want
    assert sum(queued) >= 10, queued


def test_the_planted_queue_that_ignores_the_drafters_is_caught(spec, alone, monkeypatch):
    """PLANTED: a plain step queued whatever the rows' drafters would do (a seeded row then
    draws in another order than alone)."""
    monkeypatch.setattr(batch_mod.Row, "stays_plain_next",
                        lambda self: not self.rules.reads_rows and self.output.remaining > 1)
    finished, _, _ = run_schedule(spec, 0, alone, requests=7)
    assert sum(got != alone[i] for i, got in finished) >= 1


def _gated(stats) -> tuple:
    return stats.probes, stats.verify_steps, stats.plain_steps, [(e.at_token, e.enabled) for e in stats.gate_events]


def test_a_switched_off_head_probes_in_a_batch_as_alone(spec, monkeypatch):
    """An MTP head that never agrees (a seeded sampled request): alone, its trial proposals and
    then its probes at growing gaps run beside the queued plain steps. A row alone in a batch,
    whose plain steps the batch queues, probes at the same tokens (before, a queued step
    skipped its rows' probes: on trial such a row never left it, switched off it never probed
    again). Planted: the queued step's probes skipped again."""
    prompt, options = REQUESTS[8]
    options = dict(options, max_tokens=80)
    alone = spec.generate(prompt, reuse=False, **options)
    assert alone.stats.probes >= 6 and not alone.stats.gate_events[0].enabled, _gated(alone.stats)

    def in_batch():
        chunks = list(spec.stream_in(spec.batch(2), prompt, reuse=False, **options))
        return sum((c.tokens for c in chunks), []), chunks[-1].stats

    tokens, stats = in_batch()
    assert tokens == alone.tokens and _gated(stats) == _gated(alone.stats)
    monkeypatch.setattr(batch_mod.Row, "probe_beside", lambda self: None)
    tokens, stats = in_batch()
    assert stats.probes < alone.stats.probes and _gated(stats) != _gated(alone.stats)


def test_the_planted_shared_replay_count_is_caught(hybrid, monkeypatch):
    spec, alone = hybrid
    real = batch_cache.RaggedCache._replay
    monkeypatch.setattr(batch_cache.RaggedCache, "_replay", lambda self, junk: real(self, [junk[0]] * len(junk)))
    finished, _, _ = run_schedule(spec, 0, alone, requests=7)
    assert sum(got != alone[i] for i, got in finished) >= 2


def test_a_row_reports_the_logprobs_it_reports_alone(spec):
    prompt, options = REQUESTS[-2]
    want = spec.generate(prompt, reuse=False, **options).logprobs
    batch = spec.batch(3)
    neighbours = [spec.stream_in(batch, p, reuse=False, **o) for p, o in REQUESTS[2:4]]
    got = []
    for chunk in spec.stream_in(batch, prompt, reuse=False, **options):
        got.extend(chunk.logprobs or [])
        for n in neighbours:
            next(n, None)
    assert [(p.token, p.top) for p in got] == [(p.token, p.top) for p in want]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 1e-5


def test_a_row_leaves_its_cache_for_the_next_request(spec, alone):
    spec.prompt_cache.clear()
    batch = spec.batch(2)
    first = [c.tokens for c in spec.stream_in(batch, REQUESTS[0][0], **REQUESTS[0][1])]
    again = spec.generate(REQUESTS[0][0], **REQUESTS[0][1])  # alone, from the row's cache
    assert sum(first, []) == again.tokens == alone[0]
    assert again.stats.cached_tokens >= len(spec.encode(REQUESTS[0][0])) - 1
    spec.prompt_cache.clear()


def test_a_long_prompt_joins_in_chunks_while_the_others_decode(spec):
    batch = spec.batch(2)
    batch.prefill_step = 64
    running = spec.stream_in(batch, REQUESTS[1][0], reuse=False, **REQUESTS[1][1])
    next(running)
    long_prompt = "one two three four five six seven eight nine ten " * 60  # ~600 tokens: 10 chunks
    joining = spec.stream_in(batch, long_prompt, raw=True, reuse=False, drafter="pld", max_tokens=4)
    empty = 0
    while True:
        before = batch.steps
        chunk = next(joining)  # one prefill chunk and one decode step of the running row
        assert batch.steps == before + 1
        assert next(running).tokens  # its token of that step, at once
        if chunk.tokens:  # its prefill ended in that step and it decoded with the other
            break
        empty += 1
    assert empty >= 9
    assert list(joining) and list(running)  # both complete


# DFlash rows (chains): each reads its own row of the target layers captured over the batch
DFLASH_REQUESTS = [
    (IMPORTS, dict(drafter="dflash", max_tokens=40)),  # its default tree: chains in a batch
    (REVERSE, dict(drafter="dflash", tree=0, temperature=0.8, seed=3, max_tokens=30)),
    ("def fib(n):", dict(drafter="dflash", tree=0, temperature=0.6, seed=7, max_tokens=30)),
    (LISTS, dict(drafter="pld", max_tokens=30)),
]


@pytest.fixture(scope="module")
def dflash_spec():
    s = mlxspec.load(str(MODELS / "mini-attn"), draft_model=str(MODELS / "mini-attn-DFlash"))
    s.astype("float32")
    alone = [s.generate(p, reuse=False, **{"tree": 0, **o}) for p, o in DFLASH_REQUESTS]
    return s, alone


def dflash_together(spec) -> tuple[list[list[int]], list]:
    batch = spec.batch(len(DFLASH_REQUESTS))
    streams = [spec.stream_in(batch, p, reuse=False, **o) for p, o in DFLASH_REQUESTS]
    stats = [None] * len(streams)

    def tokens_of(j):
        def read(chunk):
            stats[j] = chunk.stats
            return chunk.tokens
        return read

    got = [[] for _ in streams]
    live = list(enumerate(streams))
    while live:
        for entry in list(live):
            j, stream = entry
            chunk = next(stream, None)
            if chunk is None:
                live.remove(entry)
            else:
                got[j].extend(tokens_of(j)(chunk))
    return got, stats


def test_dflash_rows_give_what_each_request_gives_alone(dflash_spec, monkeypatch):
    """DFlash rows drafting chains side by side, at temperature 0 and seeded > 0, each with its
    own row of the captured layers, their blocks run as one forward: each request's tokens are
    its own (chains) alone, and the drafts were kept. Planted, next test: every row given the
    first row's captures."""
    spec, alone = dflash_spec
    blocks = []  # the rows of each batched block forward
    real = DFlashDraftModel.forward_rows
    monkeypatch.setattr(DFlashDraftModel, "forward_rows", lambda self, embedded, cache, positions: (
        blocks.append(embedded.shape[0]), real(self, embedded, cache, positions))[1])
    got, stats = dflash_together(spec)
    assert 3 in blocks, blocks  # the three DFlash rows' blocks, as one forward
    assert got == [r.tokens for r in alone]
    assert [s.drafter for s in stats] == ["dflash", "dflash", "dflash", "pld"]
    assert all(s.accepted > 0 for s in stats[:3]), [(s.drafted, s.accepted) for s in stats]
    # the seeded rows keep what they keep alone; the greedy one may draft and keep more (it
    # drafts into the deepest row's block: tests/test_batch_together.py)
    assert [s.accepted for s in stats[1:3]] == [r.stats.accepted for r in alone[1:3]]
    assert stats[0].accepted >= alone[0].stats.accepted


def test_the_planted_first_rows_captures_for_all_dflash_rows_are_caught(dflash_spec, monkeypatch):
    spec, alone = dflash_spec
    real = BatchedDecoder._forward

    def first_rows(self, inputs, rows):
        logits, hidden = real(self, inputs, rows)
        first = next((h for h, r in zip(hidden, rows) if r.capture), None)
        return logits, [first if r.capture else h for h, r in zip(hidden, rows)]

    monkeypatch.setattr(BatchedDecoder, "_forward", first_rows)
    got, _ = dflash_together(spec)
    assert got[0] == alone[0].tokens  # temperature 0: drafts change nothing of the output
    assert got[1] != alone[1].tokens and got[2] != alone[2].tokens  # seeded rows drew on other drafts


def test_refusals_name_why(spec):
    from functools import partial

    from mlxspec.api import GenerationRequest

    # seeded: no verify-cost timing, which these refusals do not read (8 s of this test's 8.5)
    GenerationRequest = partial(GenerationRequest, seed=0)  # noqa: N806

    assert spec.batch_plan(GenerationRequest(drafter="mtp"))[0] is not None
    dflash = mlxspec.load(str(MODELS / "mini-attn"), draft_model=str(MODELS / "mini-attn-DFlash"))
    assert dflash.batch_plan(GenerationRequest(drafter="dflash"))[0] is not None  # chains in a batch
    trees = GenerationRequest(drafter="dflash", tree=8)
    assert dflash.batch_plan(trees)[1] == "drafter dflash with trees is served alone"
    assert spec.batch_plan(GenerationRequest(logprobs=2, drafter="pld"))[0] is not None
    assert spec.batch_plan(GenerationRequest(drafter="pld", tree=4))[1] == "drafter pld with trees is served alone"
    gemma = mlxspec.load(str(MODELS / "mini-gemma4"))  # sliding-window layers
    plan, why = gemma.batch_plan(GenerationRequest(drafter="pld"))
    assert plan is None and "RotatingKVCache" in why
    with pytest.raises(UsageError, match="RotatingKVCache"):
        gemma.stream_in(gemma.batch(2), "hi", drafter="pld")
    with pytest.raises(UsageError):
        spec.batch(0)


# -- temperature > 0: the distribution of each row kind, neighbours at other temperatures ----------

ALPHA = 1e-3
LENGTH = DEPTH = 3
SUBJECT = ([2, 0, 6, 2, 0, 6, 2], SamplingParams(temperature=0.35))  # test_distribution's pld case
NEIGHBOUR = ([2, 3, 2, 3, 2, 3, 2], SamplingParams(temperature=0.25))
N = 360  # draws of each kind: power >= 0.9 (test_the_batch_battery_has_power)
N_PLANTED = 180  # the planted bug fails the battery at its own level


@pytest.fixture(scope="module")
def vocab8(tiny_vocab8):
    model = mlx_lm.load(str(tiny_vocab8))[0]
    exact = {name: exact_joint(model, prompt, LENGTH, params) for name, (prompt, params) in
             (("subject", SUBJECT), ("neighbour", NEIGHBOUR))}
    return model, exact


def draw_rows(model, n: int, seed: int) -> dict[str, Counter]:
    """N draws of each kind's first LENGTH tokens: a batch of a greedy row, 3 subjects and 3
    neighbours (their prefills join a step apart), max_tokens LENGTH + 1 or + 2 (the greedy
    row's 12: it outlives the others). The subjects are unseeded and draft 1 token of their
    own: they draft on into the pads the other rows' deeper drafts leave (batch_step.fill_pads),
    so their positions 2 and 3 are only ever drafted there. (Unseeded rows take their first key
    from MLX's global generator: seeded here, the run repeats.)"""
    counts = {"subject": Counter(), "neighbour": Counter()}
    kinds = ["greedy"] + ["subject", "neighbour"] * 3
    mx.random.seed(seed)
    for b in range(n // 3):
        batch = BatchedDecoder(model, len(kinds))
        rows = []
        for j, kind in enumerate(kinds):
            prompt, params = {"subject": SUBJECT, "neighbour": NEIGHBOUR}.get(kind, (SUBJECT[0][:5], SamplingParams()))
            depth = 1 if kind == "subject" else DEPTH
            plan = RowPlan(PromptLookupDrafter(max_ngram=2, min_ngram=1), DEPTH, depth=depth, gates=False)
            max_tokens = 40 if kind == "greedy" else LENGTH + 1 + j % 2
            rows.append((kind, batch.add(prompt, sampling=params, max_tokens=max_tokens, stop_tokens=set(),
                                         plan=plan, seed=None if kind == "subject" else seed + b * len(kinds) + j)))
        for kind, row in rows:
            got = [t for new, _ in row.updates() for t in new]
            if kind != "greedy":
                counts[kind][tuple(got[:LENGTH])] += 1
    return counts


def test_the_batch_battery_has_power(vocab8):
    _, exact = vocab8
    for probs in exact.values():
        assert simulated_power(probs, shift_at(probs, 1), N, ALPHA, battery_keys(probs)) >= 0.9


def test_each_row_samples_its_own_exact_distribution(vocab8, monkeypatch):
    model, exact = vocab8
    # each kind's verifies, by the draft position that was rejected
    rejected = {"subject": Counter(), "neighbour": Counter()}
    kind_of = {SUBJECT[1].temperature: "subject", NEIGHBOUR[1].temperature: "neighbour"}

    def spy(params, target_lp, draft, draft_lp=None):
        n_acc, out = accept(params, target_lp, draft, draft_lp)
        if params.temperature in kind_of and n_acc.item() < draft.shape[0]:
            rejected[kind_of[params.temperature]][n_acc.item() + 1] += 1
        return n_acc, out

    monkeypatch.setattr(batch_step, "accept", spy)
    counts = draw_rows(model, N, 1000)
    # residuals drawn at every position of the subjects' drafts: past the first, drafted only
    # into the pads the greedy row's deeper drafts leave
    assert min(rejected["subject"][i] for i in (1, 2, 3)) >= 10, rejected
    for kind, probs in exact.items():
        p = battery_pvalues(counts[kind], probs, N, battery_keys(probs))
        assert min(p.values()) > ALPHA / len(p), (kind, p)


def one_sampler_for_the_batch(real):
    """PLANTED: every row samples with the first row's parameters (the greedy row's; its own
    random stream kept), as a batch with one sampler does."""
    def decode(self):
        for r in self.rows:
            r.sampling = replace(self.rows[0].sampling, keys=r.sampling.keys)
        real(self)
    return decode


def test_the_planted_single_sampler_is_caught_by_the_battery(vocab8, monkeypatch):
    model, exact = vocab8
    monkeypatch.setattr(BatchedDecoder, "_decode", one_sampler_for_the_batch(BatchedDecoder._decode))
    counts = draw_rows(model, N_PLANTED, 5000)
    probs = exact["neighbour"]  # sampled greedily
    p = battery_pvalues(counts["neighbour"], probs, N_PLANTED, battery_keys(probs))
    assert min(p.values()) < ALPHA / len(p) / 100, p
