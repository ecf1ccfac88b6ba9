"""Queued verifies for a batch: the single-request loop's pipelining (speculate.py) for all rows
at once.

Before a verify step's results are read, guess that every row keeps all its drafts, that the
target then says what the row's drafter expects (``Drafter.peek``), and what the drafter will
propose after it; queue that next verify's forward for the whole batch, so it runs on the
device while the host reads this step and plans the next. The next step uses the queued
forward only when every row's plan is exactly its guess (same committed length, same drafts,
so the same width); otherwise the queued positions are rolled back from every row, which
leaves each row's cache as if nothing had been queued. The acceptance draws are made when the
queued forward is used, in the same order as without it: a row's tokens do not change.

Terms: a guess is all or nothing for the batch (one forward serves every row); a row whose
verify had pad positions (a shorter draft than the step's width) cannot guess, since its
queued positions would follow junk. Only host drafters guess (prompt lookup: ``peek`` is free),
only rows whose rows nobody reads (no constraint, penalties or logprobs), and only KV-cache
targets (a recurrent layer's tape covers one forward). As in the single-request loop, the guess
is checked on every step, queued or not, and queued only while its hit rate is high
(``gates.AheadGate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx

from .gates import AheadGate

if TYPE_CHECKING:
    from .batch_cache import RaggedCache

# Rows and steps are engine/batch.py's ``Row`` and ``Step`` (that module imports this one).


@dataclass
class BatchGuess:
    """The batch's next verify if every row keeps all its drafts: per row (in the batch's
    order) its committed length then, the target's next token and the drafts after it;
    ``logits`` (B, width, V) once queued."""

    rows: list
    starts: list[int]
    bonus: list[int]
    drafts: list[tuple[int, ...]]
    width: int
    logits: mx.array | None = None

    def inputs(self, pad: int) -> mx.array:
        return mx.array([[b, *d] + [pad] * (self.width - 1 - len(d)) for b, d in zip(self.bonus, self.drafts)],
                        mx.uint32)


class BatchAhead:
    """The batch's guesses: :meth:`make` after a verify is launched, :meth:`confirmed` once it
    is read, :meth:`settle` when the next step is planned, :meth:`drop` before the batch changes."""

    def __init__(self, cache: RaggedCache):
        self.cache = cache
        self.gate = AheadGate()
        self.guess: BatchGuess | None = None

    @staticmethod
    def can_guess(rows: Sequence, cache: RaggedCache) -> bool:
        return not cache.recurrent and all(
            r.drafter is not None and not r.drafter.uses_model and not r.needs_hidden and not r.rules.reads_rows
            for r in rows)

    def make(self, rows: Sequence, plans: Sequence, width: int) -> BatchGuess | None:
        """The guess after this verify of WIDTH (None: some row cannot guess)."""
        if width < 2:
            return None
        starts, bonus, drafts = [], [], []
        for r, p in zip(rows, plans):
            k = len(p.host)
            k_next = min(k, r.output.remaining - (k + 1) - 1)
            if p.draft is None or k != width - 1 or k_next < 1:
                return None
            found = r.drafter.peek(r.tokens, list(p.host), k_next + 1)
            if len(found) < k_next + 1:
                return None
            starts.append(len(r.tokens) + k + 1)
            bonus.append(found[0])
            drafts.append(tuple(found[1:]))
        return BatchGuess(list(rows), starts, bonus, drafts, 1 + max(len(d) for d in drafts))

    def queue(self, guess: BatchGuess, pad: int) -> None:
        """Run GUESS's forward behind the verify in flight (while the hit rate is high)."""
        self.guess = guess
        if self.gate.on:
            guess.logits, _, _ = self.cache.forward(guess.inputs(pad))
            mx.async_eval(guess.logits)

    def confirmed(self, plans: Sequence, kept: Sequence[int], last: Sequence[int]) -> int:
        """This verify's outcome (per row: drafts kept, the target's own token after them):
        whether the guess still holds. Returns the positions every row must roll back besides
        its own junk: the queued forward's width when it was queued and no longer holds, else 0."""
        g = self.guess
        if g is None or all(n == len(p.host) and t == b for p, n, t, b in zip(plans, kept, last, g.bonus)):
            return 0
        self.guess = None
        self.gate.observe(False)
        if g.logits is None:
            return 0
        for r in g.rows:
            r.stats.queued_dropped += 1
        return g.width

    def settle(self, rows: Sequence, plans: Sequence, width: int) -> mx.array | None:
        """The queued logits when every row's plan is its guess (None: run the verify; a
        queued forward that is not this verify is rolled back)."""
        g, self.guess = self.guess, None
        if g is None:
            return None
        hit = (g.rows == list(rows) and width == g.width
               and all(len(r.tokens) == s and p.host == d for r, p, s, d in zip(rows, plans, g.starts, g.drafts)))
        self.gate.observe(hit)
        if g.logits is None:
            return None
        if hit:
            for r in rows:
                r.stats.queued_used += 1
            return g.logits
        self._undo(g)
        return None

    def drop(self) -> None:
        """Before rows join or leave: a queued forward is rolled back from every row."""
        g, self.guess = self.guess, None
        if g is not None and g.logits is not None:
            self._undo(g)

    def _undo(self, g: BatchGuess) -> None:
        for r in g.rows:
            r.stats.queued_dropped += 1
        self.cache.rollback([g.width] * len(g.rows))
