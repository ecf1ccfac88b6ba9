"""Pipelined steps for a batch of greedy rows (engine/batch.py): each step launches the batch's
next forward before it reads the one in flight, so the host builds, launches and plans while
the device computes (the single-request loop's queued steps, speculate.py, for every row at
once, each row guessing on its own).

Terms:
- flight: a launched forward of every row, its results not read yet;
- entry: one row's share of a flight: the token it feeds first, then its drafts (pads after
  them up to the flight's width). An entry is
  - real: planned from the row's committed tokens (``Row.plan``), as an unpipelined step is;
  - a guess on the flight before it, made before that one is read: a row that fed drafts
    guesses that the target keeps them all and then says what the drafter expects
    (``Drafter.peek``), and drafts on from there; a row that fed no drafts and stays plain
    (``Row.stays_plain_next``) feeds whatever token the flight before picks, on the device;
  - junk: a row with nothing to guess; its positions are rolled back and it plans for real
    next.
- A guess holds when the flight before gives what it guessed. One that does not turns to
  junk: its positions are rolled back with the rejected drafts before them, and the row's
  next entry is real. A row so loses one forward for each missed guess, where unpipelined
  every step of every row waits for the device.

Exactness: only greedy rows with nothing reading their rows are pipelined (:meth:`Pipeline.eligible`).
Such a row's tokens are the target's argmax at each committed position, whatever it verifies
at a step, and an entry is used only when it feeds the row's committed tokens at their own
positions (real, or a guess that held). Rows sampling at temperature > 0 take the unpipelined
steps, whose draws are made in the single-request loop's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from .batch_step import Step, fill_pads, greedy_accept, greedy_rows
from .drafters.base import Draft

REAL, GUESS, PLAIN, JUNK = "real", "guess", "plain", "junk"  # PLAIN: fed the token before, on the device

# Rows are engine/batch.py's ``Row`` (that module imports this one).


@dataclass
class Entry:
    """One row's share of a flight (see the terms above)."""

    kind: str
    first: int  # the token fed first (PLAIN: a placeholder, the device's token replaces it)
    drafts: tuple[int, ...] = ()
    step: Step | None = None  # a real entry's plan
    held: int = 0  # positions of its flight the row's cache still holds

    @property
    def live(self) -> bool:
        return self.kind != JUNK

    def plan(self) -> Step:
        """The step the row commits (a guess: its drafts as a host draft)."""
        if self.step is not None:
            return self.step
        if not self.drafts:
            return Step()
        return Step(Draft(mx.array(self.drafts, mx.uint32), host=list(self.drafts)), self.drafts,
                    drafted=len(self.drafts))


@dataclass
class Flight:
    """A launched forward: its rows (in the batch's order; rows leave from it), their entries,
    each row's index into N_ACC (B,) and TOKENS (B, W) (``greedy_accept``'s, on the device)."""

    rows: list
    entries: list[Entry]
    slot: list[int]
    n_acc: mx.array
    tokens: mx.array


class Pipeline:
    """The batch's flights: :meth:`step` reads one, launching the next first unless draining;
    :meth:`leave` takes a row out of the one in flight."""

    def __init__(self, cache, forward: Callable, pad: int):
        self.cache = cache  # batch_cache.RaggedCache
        self.forward = forward  # (inputs (B, W), rows) -> (logits (B, W, V), hidden)
        self.pad = pad
        self.flight: Flight | None = None

    @staticmethod
    def eligible(rows: Sequence) -> bool:
        """Whether ROWS may be pipelined: two or more (one row runs the single-request loop's
        own queued steps), each greedy with nothing reading its rows and drafting on the host
        (prompt lookup) or not at all."""
        return len(rows) >= 2 and greedy_rows(rows) and all(
            not r.needs_hidden and (r.drafter is None or not r.drafter.uses_model) for r in rows)

    def step(self, rows: list, drain: bool = False) -> None:
        """Read the flight in flight (launched now if there is none); unless DRAIN (rows are
        about to join), launch the next one before reading it."""
        f = self.flight or self._launch(rows, [self._real(r) for r in rows])
        assert f.rows == rows, (len(f.rows), len(rows))
        nxt = None if drain else self._launch(rows, self._guesses(f), f)
        kept, picks = f.n_acc.tolist(), f.tokens.tolist()  # the wait for the device
        back = []
        for i, (r, e) in enumerate(zip(rows, f.entries)):
            x = nxt.entries[i] if nxt is not None else None
            b = 0
            if e.live:
                n = kept[f.slot[i]]
                last = picks[f.slot[i]][n]
                r.commit(list(e.drafts[:n]) + [last], e.plan(), n, None, None)
                b, e.held = e.held - 1 - n, 1 + n
                holds = x is not None and not r.finished and self.holds(e, x, n, last)
            else:
                assert x is None or x.kind == REAL, x.kind
                holds = x is not None
            if x is not None and x.kind == GUESS:  # a queued verify, as the single-request loop counts them
                if holds:
                    r.stats.queued_used += 1
                else:
                    r.stats.queued_dropped += 1
            if x is not None and not holds:
                b, x.held, x.kind = b + x.held, 0, JUNK
            back.append(b)
        if any(back):
            self.cache.rollback(back)
        self.flight = nxt

    @staticmethod
    def holds(e: Entry, x: Entry, n: int, last: int) -> bool:
        """Whether X, guessed on E, feeds what E gave: N of its drafts kept, then LAST."""
        return x.kind == PLAIN or (x.kind == GUESS and n == len(e.drafts) and last == x.first)

    def leave(self, row) -> None:
        """ROW leaves the batch: its positions of the flight in flight are rolled back (its cache
        then holds its committed tokens but the last) and it is taken out of the flight."""
        f = self.flight
        if f is None:
            return
        i = f.rows.index(row)
        if f.entries[i].held:
            self.cache.rollback([f.entries[i].held if j == i else 0 for j in range(len(f.rows))])
        del f.rows[i], f.entries[i], f.slot[i]
        if not f.rows:
            self.flight = None

    # -- entries ----------------------------------------------------------------------
    def _real(self, r) -> Entry:
        step = r.read(r.plan())
        return Entry(REAL, r.tokens[-1], step.host, step)

    def _guesses(self, f: Flight) -> list[Entry]:
        """The next flight's entries, guessed on F (not read yet); F's pad positions, junk
        whatever it gives, are rolled back first so that a guess follows the drafts."""
        pads = [e.held - 1 - len(e.drafts) if e.live else 0 for e in f.entries]
        if any(pads):
            self.cache.rollback(pads)
        for e, p in zip(f.entries, pads):
            e.held -= p
        return [self._guess(r, e) for r, e in zip(f.rows, f.entries)]

    def _guess(self, r, e: Entry) -> Entry:
        if not e.live:
            return self._real(r)
        if not e.drafts and r.stays_plain_next():
            return Entry(PLAIN, self.pad)
        left = r.output.remaining - len(e.drafts) - 1  # tokens still due if E keeps every draft
        if r.drafter is None or left < 1:
            return Entry(JUNK, self.pad)
        r.gate.at_context(len(r.tokens) + len(e.drafts) + 1)
        k = max(0, min(r.gate.depth(), left - 1))
        r.gate.flush(r.stats.record_gate)
        found = r.drafter.peek(r.tokens, list(e.drafts), k + 1)
        if not found:
            return Entry(JUNK, self.pad)
        return Entry(GUESS, found[0], tuple(found[1: k + 1]))

    def _launch(self, rows: list, entries: list[Entry], before: Flight | None = None) -> Flight:
        """Launch ENTRIES' forward (B rows x the widest entry) and its acceptance; PLAIN
        entries feed BEFORE's tokens (greedy_accept's, on the device)."""
        width = 1 + max(len(e.drafts) for e in entries)
        plans = fill_pads(rows, [e.step if e.kind == REAL else Step() for e in entries], width)
        for e, p in zip(entries, plans):
            if e.kind == REAL:
                e.step, e.drafts = p, p.host
        host = mx.array([[e.first, *e.drafts] + [self.pad] * (width - 1 - len(e.drafts)) for e in entries],
                        mx.uint32)
        if any(e.kind == PLAIN for e in entries):
            assert before is not None and before.rows == rows
            mine = before.tokens[mx.array(before.slot, mx.int32), 0].astype(mx.uint32)  # (B,)
            device = mx.array([e.kind == PLAIN for e in entries])
            host = mx.concatenate([mx.where(device, mine, host[:, 0])[:, None], host[:, 1:]], axis=1)
        logits, _ = self.forward(host, rows)
        assert logits.shape[:2] == (len(rows), width), logits.shape  # (B, W, V)
        n_acc, tokens = greedy_accept(logits, [e.drafts for e in entries])
        mx.async_eval(n_acc, tokens)
        for e in entries:
            e.held = width
        return Flight(list(rows), entries, list(range(len(rows))), n_acc, tokens)
