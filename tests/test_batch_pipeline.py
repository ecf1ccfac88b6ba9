"""Pipelined batch steps (engine/batch_pipeline.py): greedy rows launch each step's successor
before it is read, every row guessing on its own (a verify keeping all its drafts, a plain
row's next token on the device) and losing a forward when its guess misses.

On mini-attn (fp32, real tokenizer): prompt-lookup and drafterless rows decoded together give
each its tokens alone, with guesses both held and missed; rows drafting a script that is wrong
at one position in six (most verifies keep every draft) likewise; rows that join (the flight
in flight drains first) and are cancelled (taken out of the flight in flight) at random steps
likewise, and a cancelled row's cache serves the next request of its prompt. Planted bugs fail
it: a guess taken when every draft was kept but the target's token was not the one guessed, a
guess made without rolling back the pads before it, and a row leaving with its positions of
the flight in flight still in its cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import mlxspec
from mlxspec.engine import batch_pipeline
from mlxspec.engine.batch import BatchedDecoder, RowPlan
from mlxspec.engine.batch_pipeline import Pipeline
from mlxspec.engine.drafters.pld import PromptLookupDrafter
from mlxspec.engine.sampling import SamplingParams
from stream_helpers import drain, random_schedule

MODELS = Path(__file__).resolve().parent.parent / "benchmarks" / "models"

IMPORTS = "import os\nimport sys\nimport os\nimport"
LISTS = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"
REVERSE = "Write a function that reverses a string."
COUNT = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
# greedy and seeded (a seeded request's gates decide on the default cost curve, not on this
# machine's timing, so each runs alike alone and in a batch)
REQUESTS = [
    (IMPORTS, dict(drafter="pld", max_tokens=40)),
    (LISTS, dict(drafter="pld", max_tokens=36)),
    (REVERSE, dict(drafter="none", max_tokens=20)),
    (COUNT, dict(drafter="pld", max_tokens=44)),
    (REVERSE, dict(drafter="pld", max_tokens=28)),
]


@pytest.fixture(scope="module")
def spec():
    s = mlxspec.load(str(MODELS / "mini-attn"))
    s.astype("float32")
    return s


@pytest.fixture(scope="module")
def alone(spec):
    return [spec.generate(p, reuse=False, seed=0, **o).tokens for p, o in REQUESTS]


class Counted:
    """Pipeline.step spied: flights read, and drained."""

    def __init__(self, monkeypatch):
        self.steps = self.drains = 0
        real = Pipeline.step

        def spy(pipe, rows, drain=False):
            self.steps += 1
            self.drains += drain
            real(pipe, rows, drain)

        monkeypatch.setattr(Pipeline, "step", spy)


def test_greedy_rows_pipelined_give_their_tokens_alone(spec, alone, monkeypatch):
    counted = Counted(monkeypatch)
    which = [0, 1, 2, 3]
    batch = spec.batch(len(which))
    rows = []
    real_add = batch.add
    batch.add = lambda *a, **k: rows.append(real_add(*a, **k)) or rows[-1]
    got = drain(spec.stream_in(batch, REQUESTS[i][0], reuse=False, seed=0, **REQUESTS[i][1]) for i in which)
    assert got == [alone[i] for i in which]
    used = sum(r.stats.queued_used for r in rows)
    assert counted.steps >= 15 and used >= 15, (counted.steps, used)
    # rows verified drafts, guessed (mini-attn's greedy text repeats: prompt lookup keeps every
    # draft here; misses are the oracle rows' below)
    assert sum(r.stats.verify_steps for r in rows) >= 15


def wrong(p: int) -> bool:
    """Whether the oracle drafts position P wrong: about one in six, at no regular step (a
    period would line every row's misses up with its verifies, so that no guess's own token
    was ever the wrong one)."""
    return random.Random(p).random() < 0.16


class Oracle(PromptLookupDrafter):
    """A host drafter that proposes SCRIPT from each position, wrong where :func:`wrong` says
    (most verifies keep every draft, so most guesses hold)."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.script = script

    def _from(self, start: int, k: int) -> list[int]:
        at = lambda p: (self.script[p] if p < len(self.script) else 0) + wrong(p)  # noqa: E731
        return [at(p) for p in range(start, start + k)] if k > 0 else []

    def lookup(self, tokens, k):
        return self._from(len(tokens), k)

    def peek(self, tokens, extra, k):
        return self._from(len(tokens) + len(extra), k)


@pytest.fixture(scope="module")
def oracles(spec):
    """Three greedy rows with Oracle drafters at depth 3 (gates off): (prompt ids, script,
    max tokens) and each one's tokens alone (the single-request loop, same drafter)."""
    from mlxspec.engine.speculate import SpeculativeDecoder

    rows, want = [], []
    for prompt, n in ((IMPORTS, 40), (LISTS, 33), (REVERSE, 46)):
        ids = spec.encode(prompt)
        script = ids + spec.generate(ids, reuse=False, max_tokens=n).tokens
        rows.append((ids, script, n))
        dec = SpeculativeDecoder(spec.target.model, drafter=Oracle(script), depth=3, gates=False)
        want.append([t for new, _ in dec.generate(ids, sampling=SamplingParams(0.0), max_tokens=n) for t in new])
    return rows, want


def run_oracles(spec, rows, pipeline: bool = True):
    batch = BatchedDecoder(spec.target.model, len(rows), pipeline=pipeline)
    added = [batch.add(ids, sampling=SamplingParams(0.0), max_tokens=n, stop_tokens=set(),
                       plan=RowPlan(Oracle(script), 3, 3, gates=False)) for ids, script, n in rows]
    return drain((r.updates() for r in added), lambda item: item[0]), [r.stats for r in added]


def test_held_guesses_keep_every_row_as_alone(spec, oracles, monkeypatch):
    counted = Counted(monkeypatch)
    rows, want = oracles
    got, stats = run_oracles(spec, rows)
    assert got == want
    used, dropped = sum(s.queued_used for s in stats), sum(s.queued_dropped for s in stats)
    assert used >= 10 and dropped >= 5, (used, dropped)
    assert counted.steps >= 10
    # unpipelined, the same rows give the same tokens in more waited steps
    assert run_oracles(spec, rows, pipeline=False)[0] == want


def test_the_planted_guess_without_the_targets_token_is_caught(spec, oracles, monkeypatch):
    """PLANTED: a guess holds whenever every draft before it was kept (the token the target
    said next not compared with the one guessed)."""
    monkeypatch.setattr(Pipeline, "holds", staticmethod(
        lambda e, x, n, last: x.kind == batch_pipeline.PLAIN or (x.kind == batch_pipeline.GUESS
                                                                and n == len(e.drafts))))
    rows, want = oracles
    assert run_oracles(spec, rows)[0] != want


def test_the_planted_guess_after_the_pads_is_caught(spec, alone, monkeypatch):
    """PLANTED: the next flight guessed without rolling back the pads of the one in flight
    (a row with a shorter draft than the flight's width then feeds its guess after them)."""
    def planted(self, f):
        return [self._guess(r, e) for r, e in zip(f.rows, f.entries)]

    monkeypatch.setattr(Pipeline, "_guesses", planted)
    which = [0, 1, 2, 3]
    batch = spec.batch(len(which))
    got = drain(spec.stream_in(batch, REQUESTS[i][0], reuse=False, seed=0, **REQUESTS[i][1]) for i in which)
    assert got != [alone[i] for i in which]


def run_schedule(spec, seed: int, alone: list, requests: int = 9):
    """REQUESTS requests join a batch of 3 at random steps; some are cancelled. Returns
    (finished: (index, tokens), cancelled count)."""
    rng = random.Random(seed)
    batch = spec.batch(3)
    queue = [rng.randrange(len(REQUESTS)) for _ in range(requests)]
    finished, cancelled, _ = random_schedule(
        batch, queue, lambda i: spec.stream_in(batch, REQUESTS[i][0], reuse=False, seed=0, **REQUESTS[i][1]),
        rng, 0.3, lambda finished, cancelled: rng.random() < 0.015)
    return finished, cancelled


def test_rows_joining_and_leaving_a_pipelined_batch_give_their_tokens_alone(spec, alone, monkeypatch):
    counted = Counted(monkeypatch)
    left_in_flight = []
    real_leave = Pipeline.leave
    monkeypatch.setattr(Pipeline, "leave",
                        lambda self, row: (left_in_flight.append(self.flight is not None), real_leave(self, row))[1])
    done = cancelled = 0
    for seed in range(2):
        finished, c = run_schedule(spec, seed, alone)
        for i, got in finished:
            assert got == alone[i], (seed, i)
        done, cancelled = done + len(finished), cancelled + c
    assert done >= 10 and cancelled >= 2, (done, cancelled)
    assert counted.drains >= 2 and sum(left_in_flight) >= 3, (counted.drains, left_in_flight)


def test_a_row_cancelled_in_flight_leaves_its_cache_for_the_next_request(spec, alone, monkeypatch):
    """A row cancelled while a flight is in flight stores its cache with that flight's positions
    rolled back (the cache over exactly the tokens it is stored under), and the next request of
    its prompt gives its tokens alone from it; PLANTED: leaving with those positions kept stores
    a cache longer than its tokens."""
    from mlxspec.engine.prefix_cache import PrefixCache

    stored = []
    real_store = PrefixCache.store
    monkeypatch.setattr(PrefixCache, "store", lambda self, tokens, target, *a: (
        stored.append((len(tokens), target.length)), real_store(self, tokens, target, *a))[1])

    def run():
        spec.prompt_cache.clear()
        stored.clear()
        batch = spec.batch(2)
        a = spec.stream_in(batch, IMPORTS, seed=0, drafter="pld", max_tokens=40)
        b = spec.stream_in(batch, COUNT, seed=0, drafter="pld", max_tokens=44)
        got = []
        while len(got) < 12:
            got.extend(next(a).tokens)
            next(b, None)
        assert batch._pipe.flight is not None
        a.close()  # cancelled, a flight in flight
        assert stored and all(length == n for n, length in stored), f"stored {stored}"
        drain([b])
        return spec.generate(IMPORTS, seed=0, drafter="pld", max_tokens=40)

    first = run()
    assert first.tokens == alone[0] and first.stats.cached_tokens == len(spec.encode(IMPORTS)) - 1

    def planted(self, row):
        f = self.flight
        if f is None:
            return
        i = f.rows.index(row)
        del f.rows[i], f.entries[i], f.slot[i]
        if not f.rows:
            self.flight = None

    monkeypatch.setattr(Pipeline, "leave", planted)
    with pytest.raises(AssertionError, match="stored"):
        run()
