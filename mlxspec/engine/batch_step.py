"""What one row of a batch feeds a step (engine/batch.py): a :class:`Step`, and the drafts
made for every row at once.

Terms (batch.py's): a row plans its step alone (``Row.plan``): plain, a verify of a draft it
made, or a wish (depth, sampling) for a drafter whose rows draft together (``drafts_together``:
MTP heads, DFlash), drafted after every row has planned by :func:`draft_together`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from .drafters.base import Draft, Drafter
from .sampling import SamplingParams, accept

# Rows are engine/batch.py's ``Row`` (that module imports this one).


@dataclass
class Step:
    """One row's share of a step: a plain step (``draft`` None) or a verify of DRAFT (cut by
    the row's constraint: ``masks`` for its rows, ``cut_q`` the q of a token cut), DRAFTED
    tokens proposed before the cut (counted whole: tokens cut are rejections). WISH: (depth,
    sampling) of a draft not made yet, made with the other rows' (:func:`draft_together`)."""

    draft: Draft | None = None
    host: tuple[int, ...] = ()
    masks: mx.array | None = None
    cut_q: mx.array | None = None
    drafted: int = 0
    wish: tuple[int, SamplingParams] | None = None

    def accept(self, row, logits: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(n accepted, the tokens after each prefix, the processed rows) from this row's LOGITS
        (W, V): the single-request loop's own steps (speculate.py) on the row's rows."""
        rules, sampling = row.rules, row.sampling
        if self.draft is None:
            lg = rules.process(row.tokens, logits[:1], [], rules.plain_masks())
            return mx.array(0), sampling.sample(lg), lg
        k = len(self.host)
        lg = rules.process(row.tokens, logits[: k + 1], list(self.host) if rules.penalties else [], self.masks)
        args = (sampling, sampling.logprobs(lg), self.draft.tokens, self.draft.logprobs)
        n_acc, out = accept(*args) if self.cut_q is None else accept(*args, self.cut_q)
        return n_acc, out, lg


def draft_together(rows: Sequence, plans: list[Step], together: bool = True) -> list[Step]:
    """PLANS with each wish drafted: the rows wishing with one kind of drafter in one
    ``propose_together`` call (an MTP head's chains share their forwards); TOGETHER false:
    each row's own ``propose`` (the same drafts; to time what drafting together saves).
    Together, a row that :func:`fills_pads` drafts as deep as the deepest wish of its kind:
    that chain or block is computed for the deepest row anyway."""
    kinds: dict[type, list[int]] = {}
    for i, p in enumerate(plans):
        if p.wish is not None:
            kinds.setdefault(type(rows[i].drafter), []).append(i)
    plans = list(plans)
    for kind, idx in kinds.items():
        deepest = max(plans[i].wish[0] for i in idx)
        ks = [min(deepest, rows[i].output.remaining - 1) if together and fills_pads(rows[i]) else plans[i].wish[0]
              for i in idx]
        propose = kind.propose_together if together else Drafter.propose_together
        drafts = propose([rows[i].drafter for i in idx], [rows[i].tokens for i in idx], ks,
                         [plans[i].wish[1] for i in idx])
        for i, draft in zip(idx, drafts, strict=True):
            plans[i] = Step() if draft is None else Step(draft, drafted=len(draft))
    return plans


def fills_pads(row) -> bool:
    """Whether ROW may draft past its own depth where the step computes positions anyway (pads
    after a shorter draft, a chain drawn for a deeper row), when nothing reads its rows (no
    constraint, penalties or logprobs):
    - a greedy row gives the target's argmax tokens whatever it drafts, so longer drafts
      change only how many it keeps in a step, never which tokens;
    - an unseeded sampling row stays exact in distribution: how far it drafts is decided
      before its verify, from nothing its acceptance draws read. A seeded row drafts as it
      would alone, so that its draws, and its tokens, repeat."""
    return not row.rules.reads_rows and (row.sampling.greedy or not row.sampling.seeded)


def fill_pads(rows: Sequence, plans: list[Step], width: int) -> list[Step]:
    """PLANS (read, so each draft is on the host) with the drafts of rows that :func:`fills_pads`
    and draft on the host for free (prompt lookup) lengthened to the step's WIDTH - 1, as far as
    the drafter finds tokens and the row has tokens left: the forward costs the same, and the
    row now keeps its pad positions when they are right. A draft that is not the first part of
    the longer one stays as it is."""
    out = []
    for r, p in zip(rows, plans, strict=True):
        k = min(width - 1, r.output.remaining - 1)
        if p.draft is None or len(p.host) >= k or r.drafter.uses_model or not fills_pads(r):
            out.append(p)
            continue
        draft = r.drafter.propose(r.tokens, k, r.sampling)
        longer = () if draft is None else tuple(draft.host_tokens())
        out.append(Step(draft, longer, drafted=len(longer)) if longer[: len(p.host)] == p.host else p)
    return out


def greedy_rows(rows: Sequence) -> bool:
    """Whether every row samples greedily with nothing reading its rows (no constraint,
    penalties or logprobs): then one argmax over the batch's logits decides every row."""
    return all(r.sampling.greedy and not r.rules.reads_rows for r in rows)


def greedy_tokens(logits: mx.array) -> mx.array:
    """(B, W, V) logits -> (B, W) tokens, as ``SamplingParams.sample`` picks them greedily:
    the argmax of the normalized log-probabilities (mlx-lm's plain decoding does the same)."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def greedy_accept(logits: mx.array, drafts: list[tuple[int, ...]]) -> tuple[mx.array, mx.array]:
    """Temperature-0 acceptance of every row at once (``sampling.accept_greedy`` per row):
    LOGITS (B, W, V), DRAFTS the rows' drafted tokens (at most W - 1 each). Returns
    (n_accepted (B,), tokens (B, W)): row i keeps its first n_i drafts and then tokens[i, n_i]."""
    b, w = logits.shape[:2]
    assert len(drafts) == b and all(len(d) < w for d in drafts), (b, w, [len(d) for d in drafts])
    tokens = greedy_tokens(logits)
    if w == 1:
        return mx.zeros((b,), mx.int32), tokens
    padded = mx.array([list(d) + [-1] * (w - 1 - len(d)) for d in drafts], mx.int32)  # -1: never a token
    same = tokens[:, :-1].astype(mx.int32) == padded
    return mx.cumprod(same.astype(mx.int32), axis=1).sum(axis=1), tokens
