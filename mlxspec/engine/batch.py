"""Several requests decoded together: one target forward a step for every row, each row
speculating, sampling, stopping and rolling back on its own.

Terms:
- row: one request in the batch, with its own committed tokens (prompt + output; the last
  one sampled, not yet fed), its own drafter instance, gate, random stream and stats;
- joining: a row still prefilling its prompt, alone (B = 1), one chunk of at most
  ``prefill_step`` tokens per :meth:`BatchedDecoder.step`, so a long prompt never stalls the
  running rows for more than a chunk; once prefilled it joins the ragged cache;
- width W: 1 + the deepest draft of the step. Row i feeds ``[last_i, draft_i..., pad...]``
  (W tokens) and keeps ``1 + accepted_i`` of them; ``batch_cache.RaggedCache`` rolls each row
  back by its own junk count.

Each row runs exactly what the single-request loop runs for it (speculate.py): the same
gate decisions, the same draws from its own random stream in the same order (``sample`` for
a plain step, ``accept`` for a verify, on the row's own rows of the logits), so a row's
tokens are those of its request served alone, at any temperature, whatever its neighbours
do. That includes the single-request loop's pipelining: a plain step of every row queues the next
plain step behind it when every row will decode plainly again (``Row.stays_plain_next``). A
batch of greedy rows that nothing else reads goes further (``batch_pipeline.py``): each step
launches its successor before it is read, every row guessing on its own, so such a row may
verify at other steps than alone, which changes none of its tokens (each is the target's
argmax at its position). A row's constraint, penalties and logprobs (``row_rules.RowRules``) shape its own rows.
Drafters: prompt lookup, none, an MTP head, a draft model and DFlash (chains): each row has
its own drafter instance (its own head, draft-model or block-drafter cache, B = 1; an MTP head
gets its row of the batched forward's hidden states, DFlash its row of the layers it reads,
captured over the batch). Rows whose drafter ``drafts_together`` (MTP heads, DFlash) hand in
a wish from :meth:`Row.plan` and are drafted in one call after every row has planned: the
heads' chains share one forward a draft position, the DFlash blocks one forward
(``propose_together``); a greedy row drafts on into positions the step computes anyway
(``batch_step.fill_pads``). The Gemma-4 assistant (it reads the target's own cache) and draft
trees are served alone (``SpecModel.batch_plan``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from ..errors import UsageError
from ..models.layer_capture import LayerCapture
from .batch_ahead import BatchAhead
from .batch_cache import RaggedCache
from .batch_pipeline import Pipeline
from .batch_step import Step, draft_together, fill_pads, greedy_accept, greedy_rows, greedy_tokens
from .cache import ModelState
from .drafters.base import Drafter
from .drafters.pld import repetition_score
from .emit import Output
from .gates import CostModel, ShadowDrafts, SpeculationGate, probe, stays_plain
from .logprobs import TokenLogprob
from .prefill import feed_prompt, restore_prefix, store
from .prefix_cache import PrefixCache
from .row_rules import RowRules
from .sampling import SamplingParams
from .stats import Stats

PAD = 0  # fed after a row's drafts up to the step's width; its positions are rolled back


@dataclass
class Queued:
    """A plain step queued behind the last: its rows, their sampled tokens (B, 1), still on the
    device, and their hidden rows (drafters that read them; else None)."""

    rows: list[Row]
    tokens: mx.array
    hidden: list[mx.array | None]


@dataclass
class RowPlan:
    """How one request decodes: what ``SpeculativeDecoder`` would run for it."""

    drafter: Drafter | None
    max_depth: int
    depth: int | None = None  # a fixed depth
    gates: bool = True
    cost: CostModel | None = None

    @classmethod
    def of(cls, decoder) -> RowPlan:
        """What DECODER (a ``SpeculativeDecoder``) would run for its request."""
        return cls(decoder.drafter, decoder.max_depth, decoder.depth, decoder.gates, decoder.cost)


class Row:
    """One request in the batch; iterate :meth:`updates` for its (new tokens, stats)."""

    def __init__(self, engine: BatchedDecoder, prompt: list[int], sampling: SamplingParams,
                 output: Output, plan: RowPlan, prefix_cache: PrefixCache | None, checkpoints: Sequence[int],
                 rules: RowRules | None = None, on_logprobs: Callable[[list[TokenLogprob]], None] | None = None):
        self.engine = engine
        self.rules = rules or RowRules()
        self.on_logprobs = on_logprobs
        self.tokens = prompt
        self.sampling = sampling
        self.output = output
        self.stats = output.stats
        self.drafter = plan.drafter
        self.needs_hidden = self.drafter is not None and self.drafter.needs_hidden
        # the target layers whose outputs it reads (DFlash) instead of the final hidden states
        self.capture = self.drafter.capture_layers if self.needs_hidden else None
        self.prefix_cache = prefix_cache
        self.checkpoints = checkpoints
        self.gate = self.shadow = None
        if self.drafter is not None:
            self.gate = SpeculationGate(self.drafter, plan.max_depth, plan.cost, fixed_depth=plan.depth,
                                        enabled=plan.gates)
            self.stats.drafter = self.drafter.name
            self.stats.depth = self.gate.max_depth
            self.stats.cost_model = "measured" if self.gate.cost.measured else "default"
            self.shadow = ShadowDrafts(self.drafter, self.gate.max_depth)
        self.out: deque[tuple[list[int], list[TokenLogprob]]] = deque()  # tokens, their logprobs
        # the single-request loop queues a plain step behind a plain one it guesses stays
        # plain, deciding it without the gate: the row decides the same way
        self.queued_plain = False
        self.error: BaseException | None = None
        self.prefill: Iterator[None] | None = None  # while joining: one chunk a next()
        self.state: ModelState | None = None  # its own cache while joining

    @property
    def finished(self) -> bool:
        return self.output.done or self.error is not None

    def updates(self) -> Iterator[tuple[list[int], Stats]]:
        """(new tokens, stats) as committed; steps the whole batch whenever this row has none
        waiting. While the row still prefills it yields ([], stats) after each step, so its
        caller can serve the other rows' tokens meanwhile. Closing it takes the row out."""
        try:
            while True:
                while not self.out and not self.finished:
                    joining = self in self.engine.joining
                    self.engine.step()
                    if joining and not self.out and not self.finished:
                        yield [], self.stats
                if self.out:
                    tokens, logprobs = self.out.popleft()
                    if self.on_logprobs is not None:
                        self.on_logprobs(logprobs)
                    yield tokens, self.stats
                elif self.error is not None:
                    raise self.error
                else:
                    return
        finally:
            self.engine.remove(self)

    # -- one step's share ----------------------------------------------------------------
    def plan(self) -> Step:
        """This row's share of the next step, decided as the single-request loop decides it."""
        remaining = self.output.remaining
        if self.drafter is None or remaining <= 1:
            return Step()
        if self.queued_plain:
            self.probe_beside()
            return Step()
        self.gate.at_context(len(self.tokens))
        k = min(self.gate.depth(), remaining - 1)
        self._sync_gate()
        if k <= 0:
            if probe(self.drafter, self.shadow, self.tokens, self.gate.probe_depth()):
                self.stats.probes += 1
            return Step()
        sampling = self.rules.draft_sampling(self.sampling, self.drafter)
        if self.drafter.drafts_together:
            return Step(wish=(k, sampling))
        draft = self.drafter.propose(self.tokens, k, sampling)
        if draft is None:
            return Step()
        return Step(draft, drafted=len(draft))  # its tokens are read by :meth:`read`

    def probe_beside(self) -> None:
        """This row's plain step is in flight (the batch queued it, or would have): a due probe
        goes beside it, as alone (a trial's or a switched-off drafter's; ``gates.probe``)."""
        if self.drafter is None or self.output.remaining <= 1:
            return
        self.gate.at_context(len(self.tokens))
        if self.gate.probes_in_flight and probe(self.drafter, self.shadow, self.tokens, self.gate.probe_depth()):
            self.stats.probes += 1

    def read(self, step: Step) -> Step:
        """STEP with its drafted tokens read from the device (every row's drafts were queued
        first, so the batch waits once, not once a row) and cut by the row's constraint."""
        if step.draft is None:
            return step
        draft, masks, cut_q = self.rules.cut(step.draft)
        return Step(draft, tuple(draft.host_tokens()), masks, cut_q, step.drafted)

    def stays_plain_next(self) -> bool:
        """Whether the step after this plain one is plain too, decided before its token is read
        (the single-request loop then queues it; see ``commit``, which decides the same)."""
        return not self.rules.reads_rows and self.output.remaining > 1 and stays_plain(
            self.drafter, self.gate, self.tokens)

    def _sync_gate(self) -> None:
        self.gate.flush(self.stats.record_gate)

    def commit(self, new: list[int], step: Step, accepted: int, rows: mx.array, hidden: mx.array | None) -> None:
        """NEW tokens follow (ACCEPTED of the step's drafts, then the target's own), sampled from
        ROWS (processed); HIDDEN: the target's rows of the kept positions, for a drafter that
        reads them."""
        drafted = step.drafted if step.draft is not None else 0
        if self.needs_hidden:
            self.drafter.add_hidden(hidden)
        self.queued_plain = step.draft is None and self.stays_plain_next()
        logprobs = self.rules.commit(new, rows)
        self.tokens.extend(new)
        if step.draft is not None:
            self.stats.record_verify(drafted, accepted)
            self.gate.observe(drafted, accepted)
            self.drafter.rollback(len(self.tokens) - 1)
            self.shadow.reset()
        else:
            self.stats.plain_steps += 1
            if self.gate is not None:
                self.gate.after_plain(self.shadow, self.tokens)
        out = self.output.take(new)
        if out:
            self.out.append((out, logprobs[: len(out)]))


class BatchedDecoder:
    """Rows join (:meth:`add`) and leave between steps; :meth:`step` advances them all."""

    def __init__(self, model: nn.Module, max_rows: int, prefill_step: int = 512, draft_together: bool = True,
                 pipeline: bool = True, compiled: bool | None = None):
        if max_rows < 1:
            raise UsageError(f"a batch needs at least one row (got {max_rows})")
        self.model = model
        self.max_rows = max_rows
        self.prefill_step = prefill_step
        self.draft_together = draft_together  # rows draft in one call (draft_together); False: one by one
        # compiled: the forwards from compiled graphs (batch_cache.py; None: on unless MLXSPEC_COMPILED_BATCH=0)
        self.cache = RaggedCache(model, compiled)
        self._captures: dict[tuple, LayerCapture] = {}  # per set of layers rows read (DFlash)
        self.rows: list[Row] = []  # in the cache's row order
        self.joining: deque[Row] = deque()
        self._queued: Queued | None = None  # a plain step queued behind the last one
        self._ahead = BatchAhead(self.cache)  # a verify queued behind the last one (batch_ahead.py)
        # greedy rows: each step's successor launched before it is read (batch_pipeline.py);
        # False: never (to time what it saves)
        self.pipeline = pipeline
        self._pipe = Pipeline(self.cache, self._forward, PAD)
        self.steps = 0  # batched forwards run
        self.row_steps = 0  # rows those forwards served, summed

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining)

    @property
    def full(self) -> bool:
        return len(self) >= self.max_rows

    def add(self, prompt: list[int], *, sampling: SamplingParams, max_tokens: int, stop_tokens: set[int],
            plan: RowPlan, seed: int | None = None, prefix_cache: PrefixCache | None = None,
            checkpoints: Sequence[int] = (), rules: RowRules | None = None,
            on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> Row:
        """A new request: it prefills over the next steps, then decodes with the others. RULES:
        its constraint, penalties and logprobs; ON_LOGPROBS gets each yield's logprobs."""
        if not prompt:
            raise UsageError("the prompt is empty")
        if self.full:
            raise UsageError(f"the batch is full ({self.max_rows} rows)")
        output = Output(Stats(prompt_tokens=len(prompt)), max_tokens, set(stop_tokens))
        row = Row(self, list(prompt), sampling.for_request(seed), output, plan, prefix_cache, checkpoints,
                  rules, on_logprobs)
        row.prefill = self._prefill(row)
        self.joining.append(row)
        return row

    def remove(self, row: Row) -> None:
        """ROW leaves (finished, failed or cancelled); its cache is kept in its prefix cache."""
        if row in self.joining:
            self.joining.remove(row)
            return
        if row in self.rows:
            self._leave(row)

    def _leave(self, row: Row) -> None:
        self._pipe.leave(row)
        i = self.rows.index(row)
        self._ahead.drop()
        if self._queued is not None:  # its share of a queued step goes with it
            q = self._queued
            q.rows.pop(i), q.hidden.pop(i)
            q.tokens = mx.concatenate([q.tokens[:i], q.tokens[i + 1:]])
            if not q.rows:
                self._queued = None
        if row.prefix_cache is not None and row.error is None:
            snap = self.cache.snapshot(i)
            if snap is not None:
                store(row.prefix_cache, row.tokens[: snap.length], snap, row.drafter)
        self.rows.pop(i)
        self.cache.keep([j for j in range(len(self.rows) + 1) if j != i])

    # -- the step ---------------------------------------------------------------------
    def step(self) -> None:
        """One prefill chunk of the first joining row, then one decode step of the rows in (a
        queued step is taken first: its rows are the batch's before anyone joins)."""
        with mx.stream(generation_stream):
            decoded = self._queued is not None or self._pipe.flight is not None
            if decoded:
                self._decode_all()
            if self.joining:
                row = self.joining[0]
                try:
                    if next(row.prefill, StopIteration) is StopIteration:
                        self.joining.popleft()
                        self._join(row)
                except Exception as err:  # this row's prompt failed: the others go on
                    self.joining.remove(row)
                    row.error = err
            if self.rows and not decoded:
                self._decode_all()

    def _decode_all(self) -> None:
        try:
            self._decode()
        except Exception as err:  # one forward for all: every row in it ends with it
            self._queued = self._ahead.guess = self._pipe.flight = None
            for r in list(self.rows):
                r.error = err
                self._leave(r)

    def _prefill(self, row: Row) -> Iterator[None]:
        """Restore the longest cached prefix, feed the rest (but the last token) a chunk per
        next(), storing at the row's checkpoints."""
        prompt, drafter = row.tokens, row.drafter
        row.state = state = ModelState(self.model, keep_hidden=row.needs_hidden, capture=row.capture)
        row.stats.cached_tokens = restore_prefix(state, prompt, drafter, row.prefix_cache)
        yield from (None for _ in feed_prompt(state, prompt, drafter, row.prefix_cache, row.checkpoints,
                                              self.prefill_step))
        if drafter is not None:
            if not drafter.uses_model:
                row.gate.prompt_check(repetition_score(prompt))
            row.gate.flush(row.stats.record_gate)

    def _join(self, row: Row) -> None:
        self._ahead.drop()
        # an empty cache (a 1-token prompt) joins as a row of zero length
        self.cache.join(row.state.cache)
        row.state = None
        self.rows.append(row)

    def _pipelines(self, rows: list[Row]) -> bool:
        """Whether this step is pipelined (batch_pipeline.py): no row joining (a flight in flight
        then drains first), no recurrent layer (its tape covers one forward)."""
        return self.pipeline and not self.joining and not self.cache.recurrent and Pipeline.eligible(rows)

    def _decode(self) -> None:
        rows = list(self.rows)
        pipelined = self._pipelines(rows)
        if self._pipe.flight is not None or (self._queued is None and pipelined):
            self._ahead.drop()
            self._pipe.step(rows, drain=not pipelined)
            self._stepped(rows)
            return
        queued, self._queued = self._queued, None
        if queued is not None:  # a plain step queued by the last one: its rows are these
            assert queued.rows == rows
            for r in rows:  # each row's due probe, queued behind the step in flight
                r.probe_beside()
            plans, width, hidden = [Step()] * len(rows), 1, queued.hidden
            together = True  # its tokens were sampled on the device, one (B, 1) array
            n_acc, tokens = mx.zeros((len(rows),), mx.int32), queued.tokens
        else:
            plans = draft_together(rows, [r.plan() for r in rows], self.draft_together)
            mx.async_eval([p.draft.tokens for p in plans if p.draft is not None and p.draft.host is None])
            plans = [r.read(p) for r, p in zip(rows, plans)]
            width = 1 + max(len(p.host) for p in plans)
            plans = fill_pads(rows, plans, width)
            logits = self._ahead.settle(rows, plans, width)  # the verify queued last step, if it is this one
            if logits is None:
                inputs = [[r.tokens[-1], *p.host] + [PAD] * (width - 1 - len(p.host)) for r, p in zip(rows, plans)]
                logits, hidden = self._forward(mx.array(inputs, mx.uint32), rows)
            else:  # rows that guess read no hidden states
                hidden = [None] * len(rows)
            assert logits.shape[:2] == (len(rows), width), logits.shape  # (B, W, V)
            together = greedy_rows(rows)
            if together:  # one argmax and one read for the whole batch
                n_acc, tokens = greedy_accept(logits, [p.host for p in plans])
            else:
                results = [p.accept(r, logits[i]) for i, (r, p) in enumerate(zip(rows, plans))]
        if together:
            mx.async_eval(n_acc, tokens)
        else:
            mx.async_eval([res[:2] for res in results])
        if width == 1:
            self._queue_plain(rows, tokens[:, :1] if together else mx.stack([o for _, o, _ in results]), pipelined)
        elif not self.joining and BatchAhead.can_guess(rows, self.cache):
            guess = self._ahead.make(rows, plans, width)
            if guess is not None:
                self._ahead.queue(guess, PAD)
        if together:
            kept, picks = n_acc.tolist(), tokens.tolist()
            lasts = [picks[i][n] for i, n in enumerate(kept)]
            results = [(None, None, None)] * len(rows)
        else:
            kept = [n.item() for n, _, _ in results]
            lasts = [out[n].item() for n, (_, out, _) in zip(kept, results)]
        extra = self._ahead.confirmed(plans, kept, lasts)  # a queued verify that no longer holds
        junk = []
        for r, p, n, last, (_, _, lg), hid in zip(rows, plans, kept, lasts, results, hidden):
            junk.append(width - 1 - n + extra)
            r.commit(list(p.host[:n]) + [last], p, n, lg, None if hid is None else hid[: n + 1])
        self.cache.rollback(junk)
        self._stepped(rows)

    def _stepped(self, rows: list[Row]) -> None:
        self.steps += 1
        self.row_steps += len(rows)
        for r in rows:  # a row that ended leaves now (its consumer still has its last tokens)
            if r.finished:
                self._leave(r)

    def _queue_plain(self, rows: list[Row], tokens: mx.array, pipelined: bool) -> None:
        """After a plain step of every row, queue the next one behind it (its inputs: this
        step's TOKENS (B, 1), still on the device) when every row will decode plainly again, as
        the single-request loop decides it; not while a row is joining (it changes the batch),
        nor when the next step is PIPELINED (``_pipelines``: it launches its own)."""
        if self.joining or pipelined or not all(r.stays_plain_next() for r in rows):
            return
        logits, hidden = self._forward(tokens.astype(mx.uint32), rows)  # (B, 1, V)
        if greedy_rows(rows):
            nxt = greedy_tokens(logits)
        else:
            nxt = mx.stack([r.sampling.sample(logits[i, :1]) for i, r in enumerate(rows)])  # (B, 1)
        mx.async_eval(nxt)
        self._queued = Queued(list(rows), nxt, hidden)

    def _forward(self, inputs: mx.array, rows: list[Row]) -> tuple[mx.array, list[mx.array | None]]:
        """The batched forward on INPUTS (B, W): logits (B, W, V) and each row's rows of what its
        drafter reads, (W, H) or (W, layers x H) (None: nothing)."""
        ids = {r.capture for r in rows if r.capture}
        assert len(ids) <= 1, ids  # one loaded drafter: every DFlash row reads the same layers
        capture = None
        if ids:
            key = next(iter(ids))
            capture = self._captures.get(key) or self._captures.setdefault(key, LayerCapture(self.model, key))
        logits, h, captured = self.cache.forward(inputs, any(r.needs_hidden and not r.capture for r in rows), capture)
        return logits, [captured[i] if r.capture else h[i] if r.needs_hidden else None for i, r in enumerate(rows)]
