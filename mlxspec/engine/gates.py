"""Gates: speculate only when it pays, at the depth that pays most.

The decision uses acceptance counts and a cost curve, never wall-clock time, so a seeded run
makes the same decisions (and so the same random draws) every time.

Expected tokens per verify at depth k, with alpha_i the chance that draft position i is
accepted given the ones before it were: E_k = 1 + sum_{j<=k} prod_{i<=j} alpha_i. A step costs
verify(k+1) + k * draft_cost target-forward units (a unit: one waited 1-token forward), plain
decoding ``plain`` units per token (below 1 where the next forward is queued while the host
reads a token, as mlx-lm's loop and ours do); speculation pays when E_k * plain / cost_k > 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .drafters.base import GREEDY, Draft, Drafter


@dataclass
class CostModel:
    """Cost of a target forward over n tokens, in units of a 1-token forward."""

    slope: float = 0.1  # extra cost per extra token where no measured curve exists
    curve: dict[int, float] = field(default_factory=dict)  # measured (engine/costs.py, tune)
    measured: bool = False
    # a draft tree's forward over a chain verify of as many rows (costs.measure_tree_factor);
    # None: not measured (tree_step.TreePolicy then assumes 1 for attention-only targets,
    # HYBRID_TREE_FACTOR for hybrids)
    tree_factor: float | None = None
    # measured within a time budget that left some widths out (costs.measure_verify_cost):
    # those follow ``slope``, itself measured; `mlxspec tune` measures every width
    partial: bool = False
    # a pipelined plain token over a waited 1-token forward (costs.plain_factor), 1 where not
    # measured: on an H100, 8B shape, plain decoding ran 8.1 ms a token where a waited forward
    # took 11.2 ms, and a gate counting a plain token at 1 kept an MTP head whose ideal was 0.73x
    plain: float = 1.0
    # How the costs grow with the context (engine/context_cost.py): the curve above was timed
    # over ``context`` tokens; ``at[L]`` is the same curve timed over L tokens and ``plain_at[L]``
    # a pipelined plain token there, all in the units above (a waited 1-token forward over
    # ``context``). Empty: not measured, the curve holds at every length. On an H200 (8B
    # shape) a waited 1-token forward grew by 8.1 ms from 128 to 32K tokens, a 2-token one by
    # 12-15 ms and a pipelined plain token by 8.6 ms: what pays is read at the length.
    context: int = 0
    at: dict[int, dict[int, float]] = field(default_factory=dict)
    plain_at: dict[int, float] = field(default_factory=dict)
    context_known: bool = False  # measured (an empty ``at`` then: the costs do not grow)

    def verify(self, n: int, context: int | None = None) -> float:
        """A forward of N tokens over CONTEXT tokens (None: the curve's own context)."""
        return _along(self.curve, n, self.slope) + max(0.0, self._grown(context, lambda L: self._extra(L, n)))

    def plain_cost(self, context: int | None = None) -> float:
        """A pipelined plain token over CONTEXT tokens. Where only the verify was timed at a
        length, a plain token there grows by what a 1-token forward grew."""
        return self.plain + self._grown(
            context, lambda L: self.plain_at[L] - self.plain if L in self.plain_at else self._extra(L, 1))

    def _extra(self, length: int, n: int) -> float:
        """What a forward of N tokens costs more over LENGTH (a measured one) than over ``context``."""
        grown = {w: c - _along(self.curve, w, self.slope) for w, c in self.at[length].items()}
        return max(0.0, _along(grown, n, None))

    def _grown(self, context: int | None, extra) -> float:
        """The growth over ``context`` at CONTEXT tokens, EXTRA(L) being the growth measured at
        each length L of ``at``: linear between them, past the last at the last two's slope."""
        if not self.at or context is None or context <= self.context:
            return 0.0
        return _along({self.context: 0.0, **{L: extra(L) for L in sorted(self.at)}}, context, None)

    def context_record(self, digits: int = 4) -> dict:
        """How the costs grow with the context, as stored (``verify_cost_context``) and reported."""
        return {"context": self.context,
                "at": {str(L): {str(n): round(c, digits) for n, c in sorted(curve.items())}
                       for L, curve in sorted(self.at.items())},
                "plain_at": {str(L): round(c, digits) for L, c in sorted(self.plain_at.items())}}

    @classmethod
    def default(cls) -> "CostModel":
        # GPUs (Metal, CUDA) are bandwidth-bound at decode: a few extra rows are nearly free.
        # The CPU backend pays roughly per row.
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
        return cls(slope=0.08 if on_gpu else 0.35)


def _along(points: dict[int, float], x: int, slope: float | None) -> float:
    """POINTS (x -> y) read at X: linear between them; past the last at SLOPE, or (None) at the
    last two points' slope (not below 0); before the first, at 1 + SLOPE per step from x = 1
    (a curve's default), or (None) the first point's value."""
    if x in points:
        return points[x]
    xs = sorted(points)
    below = [w for w in xs if w < x]
    above = [w for w in xs if w > x]
    if below and above:  # interpolate between measured points
        lo, hi = below[-1], above[0]
        return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    if below:  # past the last: extend
        lo = below[-1]
        if slope is None:
            slope = max(0.0, (points[lo] - points[below[-2]]) / (lo - below[-2])) if len(below) > 1 else 0.0
        return points[lo] + slope * (x - lo)
    return points[xs[0]] if slope is None else 1.0 + slope * (x - 1)


class AcceptanceModel:
    """Decayed counts of how often each draft position was reached and accepted."""

    def __init__(self, max_depth: int, prior: float = 0.6, prior_weight: float = 1.0, decay: float = 0.9):
        self.reached = [0.0] * max_depth
        self.accepted = [0.0] * max_depth
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(len(self.reached)):
            self.reached[i] *= self.decay
            self.accepted[i] *= self.decay
        for i in range(min(drafted, accepted + 1, len(self.reached))):
            self.reached[i] += 1.0
            self.accepted[i] += 1.0 if i < accepted else 0.0

    def copy(self) -> "AcceptanceModel":
        model = AcceptanceModel(len(self.reached), self.prior, self.prior_weight, self.decay)
        model.reached, model.accepted = list(self.reached), list(self.accepted)
        return model

    def alphas(self) -> list[float]:
        # Each position's prior is the previous position's estimate: deep positions with no
        # data look like the deepest one observed, not like a fresh guess.
        out, prev = [], self.prior
        for r, a in zip(self.reached, self.accepted):
            prev = (a + self.prior_weight * prev) / (r + self.prior_weight)
            out.append(prev)
        return out

    @classmethod
    def from_counts(cls, reached, accepted, max_depth: int) -> "AcceptanceModel":
        """An estimate from plain per-position counts (a tune run's), with the default prior."""
        model = cls(max_depth)
        model.reached = [float(x) for x in reached[:max_depth]] + [0.0] * (max_depth - len(reached))
        model.accepted = [float(x) for x in accepted[:max_depth]] + [0.0] * (max_depth - len(accepted))
        return model

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for alpha in self.alphas()[:k]:
            run *= alpha
            total += run
        return total


def expected_speedup(acceptance: AcceptanceModel, k: int, cost: CostModel, draft_cost: float,
                     step_cost: float = 0.0, context: int | None = None) -> float:
    """Speed of drafting ``k`` tokens a step relative to plain decoding: E_k tokens per step
    over the step's cost, verify(k+1) + k * draft_cost + step_cost (a block drafter's one
    forward), in target-forward units, times what a plain token costs in them (``cost.plain``),
    both over CONTEXT tokens where the cost model knows how they grow."""
    verify = cost.verify(k + 1, context) + k * draft_cost + step_cost
    return acceptance.expected_tokens(k) * cost.plain_cost(context) / verify


class SpeculationGate:
    """Per step: depth to draft (0 = decode plainly). Records why it switched on or off."""

    ON_ABOVE = 1.10  # hysteresis: switch on when the best depth is 10% faster than plain
    OFF_BELOW = 1.0
    # Steps with drafts observed before the estimate may switch speculation off: the prior alone
    # (no evidence yet) must not, or a drafter that pays is cut at token 0 and only comes back
    # through backed-off probes (seen with an MTP head: off at token 0, on at 121).
    MIN_EVIDENCE = 8
    # ... unless not one drafted token has been accepted yet: then 3 steps are enough (a head
    # that never agrees cost 8 failed verifies per request, 10-20% of a short answer on
    # CUDA hybrid shapes, where a failed verify costs about two plain steps).
    MIN_EVIDENCE_NONE_ACCEPTED = 3
    # Longest gap between probes while speculation is off (plain tokens).
    MAX_PROBE_GAP = 512
    # The context the costs are read at moves in steps of this many tokens: the estimate is
    # recomputed once a step, not every token, and a run's decisions follow its token count.
    CONTEXT_STEP = 256

    def __init__(
        self,
        drafter: Drafter,
        max_depth: int,
        cost: CostModel | None = None,
        fixed_depth: int | None = None,
        enabled: bool = True,
    ):
        self.drafter = drafter
        self.max_depth = fixed_depth or max_depth
        self.fixed_depth = fixed_depth
        self.cost = cost or CostModel.default()
        self.gating = enabled
        self.model = AcceptanceModel(self.max_depth)
        self.on = True
        self.events: list[tuple[bool, str]] = []
        self._since_off = 0
        self._probe_every = 16
        self._best: tuple[int, float] | None = None
        self._evidence = 0
        self._accepted = 0
        self.context = 0  # tokens in the cache as of the last at_context(), in CONTEXT_STEPs
        # A model drafter (MTP head, draft model, assistant, DFlash) is first on trial: its
        # proposals are checked against the plain tokens that follow, not verified, until one
        # agrees (speculation starts) or MIN_EVIDENCE_NONE_ACCEPTED did not (off). A failed
        # verify costs about two plain steps on CUDA; a trial proposal one drafter forward.
        # A depth the user fixed speculates from the start (the gate may still turn it off).
        self.trial = enabled and drafter.uses_model and not fixed_depth

    # -- estimates ------------------------------------------------------------
    def speedup(self, k: int, model: AcceptanceModel | None = None) -> float:
        """Expected speed of depth K against plain decoding, by MODEL (default: the gate's own)."""
        step = getattr(self.drafter, "cost_per_step", 0.0)  # drafters outside the Drafter class have none
        return expected_speedup(model or self.model, k, self.cost, self.drafter.cost_per_token, step, self.context)

    def at_context(self, tokens: int) -> None:
        """The cache holds TOKENS now: costs are read at that length (rounded down to a
        CONTEXT_STEP), so a verify that grows dearer with the context than a plain token
        switches drafting off there."""
        context = tokens - tokens % self.CONTEXT_STEP
        if context != self.context:
            self.context = context
            if self.cost.at:
                self._best = None

    def best_depth(self) -> tuple[int, float]:
        # Asked once per token while decoding plainly: recomputed only after new observations.
        if self._best is None:
            self._best = self.best_depth_by(self.model)
        return self._best

    def best_depth_by(self, model: AcceptanceModel) -> tuple[int, float]:
        """(depth, expected speedup) of the best depth MODEL says this gate may draft at."""
        if self.fixed_depth:
            return self.fixed_depth, self.speedup(self.fixed_depth, model)
        return max(((k, self.speedup(k, model)) for k in range(1, self.max_depth + 1)), key=lambda x: x[1])

    # -- decisions --------------------------------------------------------------
    def switch(self, on: bool, reason: str) -> None:
        if on != self.on:
            self.on = on
            self.events.append((on, reason))
            self._since_off = 0

    def prompt_check(self, score: float, threshold: float = 0.1) -> None:
        """Prompt lookup only starts on prompts that repeat themselves."""
        if self.gating and score < threshold:
            self.switch(False, f"prompt repetition score {score:.2f} < {threshold:.2f}")
            # Until the output shows otherwise, expect drafts to fail as often as the prompt says.
            self.model.prior = score
            self._best = None

    def depth(self) -> int:
        if not self.gating:
            return self.max_depth if self.fixed_depth else self.best_depth()[0]
        if self.trial:
            if self._accepted:
                self.trial = False
            elif self._evidence >= self.MIN_EVIDENCE_NONE_ACCEPTED:
                self.trial = False
                self.switch(False, f"no draft agreed with the model in {self._evidence} trial proposals")
            else:
                return 0
        k, gain = self.best_depth()
        enough = self.MIN_EVIDENCE if self._accepted else self.MIN_EVIDENCE_NONE_ACCEPTED
        if self.on and gain < self.OFF_BELOW and self._evidence >= enough:
            self.switch(False, f"drafts stopped paying (expected {gain:.2f}x)")
        elif not self.on and gain > self.ON_ABOVE:
            self.switch(True, f"drafts pay again (expected {gain:.2f}x)")
        return k if self.on else 0

    @property
    def shadowing(self) -> bool:
        """Whether proposals are checked against plain tokens instead of verified (off, or on trial)."""
        return self.gating and (self.trial or not self.on)

    def probe_depth(self) -> int:
        """Depth of a model drafter's proposal to check against the coming plain tokens, asked
        when ``depth()`` said 0: while on trial every time, while off now and then, backing
        off (prompt lookup needs none: its shadow proposals are free); 0: none due."""
        if not self.drafter.uses_model or not self.shadowing:
            return 0
        if self.trial:
            return 1
        if not self._probe_due():
            return 0
        self._since_off = 0
        self._probe_every = min(self._probe_every * 2, self.MAX_PROBE_GAP)
        return 1

    def _probe_due(self) -> bool:
        return self.drafter.uses_model and self._since_off >= self._probe_every

    def would_draft(self) -> bool:
        """Cheap guess of whether the next ``depth()`` will be non-zero (for pipelining). A
        probe due counts only for a drafter that cannot probe beside a queued plain step
        (``Drafter.probes_in_flight``; :func:`probe`). On trial, such a drafter only probes,
        so the plain steps stay queued until the trial is decided (then ``depth()`` ends it)."""
        if self.trial and self.gating and self.probes_in_flight:
            return bool(self._accepted) or self._evidence >= self.MIN_EVIDENCE_NONE_ACCEPTED
        if self.on or not self.gating:  # on trial too: it is on until the trial fails
            return True
        return self.best_depth()[1] > self.ON_ABOVE or (self._probe_due() and not self.probes_in_flight)

    @property
    def probes_in_flight(self) -> bool:
        """Whether the drafter's probes may run beside a queued plain step (``Drafter.probes_in_flight``;
        drafters outside the Drafter class: no)."""
        return getattr(self.drafter, "probes_in_flight", False)

    def tick_plain(self) -> None:
        """One token was decoded plainly."""
        if not self.on:
            self._since_off += 1

    def after_plain(self, shadow: ShadowDrafts, tokens: list[int]) -> None:
        """One token was decoded plainly (TOKENS now end with it): count it and, while
        shadowing, settle SHADOW's proposal against it, or early (see :meth:`decided_early`)."""
        self.tick_plain()
        if self.shadowing:
            settled = shadow.update(tokens)
            if settled:
                self.observe(*settled)
            elif self.decided_early(shadow.pending(tokens)):
                shadow.reset()

    def decided_early(self, pending: tuple[int, int] | None) -> bool:
        """PENDING = (drafted, matched so far) of a shadow proposal not settled yet. While off,
        if even a miss at its next token would switch drafting on, that proposal cannot decide
        otherwise: record the MATCHED tokens as a draft of that length, all accepted (they
        were), and let the gate switch on now instead of after the rest of the proposal has
        passed as plain tokens (a depth-8 proposal kept prompt lookup off for 8 more tokens)."""
        if pending is None or self.on or self.trial or not self.gating:
            return False
        drafted, matched = pending
        if matched < 1:
            return False
        worst = self.model.copy()
        worst.observe(drafted, matched)  # the next token misses
        if self.best_depth_by(worst)[1] <= self.ON_ABOVE:
            return False
        self.observe(matched, matched)
        return True

    def flush(self, record) -> None:
        """Hand each switch since the last flush to RECORD(on, reason) (Stats.record_gate)."""
        for on, reason in self.events:
            record(on, reason)
        self.events.clear()

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.model.observe(drafted, accepted)
            self._best = None
            self._evidence += 1
            self._accepted += accepted
        if self.on:
            self._probe_every = 16


def stays_plain(drafter: Drafter | None, gate: SpeculationGate | None, tokens: list[int]) -> bool:
    """Guess, before the in-flight token is known, whether the next step will be plain too
    (then it is queued behind this one, and decided plain without asking the gate)."""
    if drafter is None or not gate.would_draft():
        return True
    return not drafter.uses_model and not drafter.lookup(tokens, 1)


def probe(drafter: Drafter, shadow: ShadowDrafts, tokens: list[int], k: int) -> bool:
    """A model drafter's greedy proposal of K tokens (no random draw taken) offered to SHADOW,
    to be checked against the plain tokens that follow instead of verified: gate evidence for
    one drafter forward. Whether one was offered. The proposal is queued, not read: it runs
    behind the plain step in flight and is read when the tokens it guessed are (reading it
    now would stop the pipelined plain steps: 4-9% a token while a head was switched off)."""
    if k <= 0:
        return False
    draft = drafter.propose(tokens, k, GREEDY)
    drafter.rollback(len(tokens) - 1)  # nothing of it is fed to the target
    if draft is None or not len(draft):
        return False
    if draft.host is None:
        mx.async_eval(draft.tokens)
    shadow.offer(tokens, draft)
    return True


class ShadowDrafts:
    """While speculation is off, check what the drafter would have proposed against the plain
    tokens: prompt lookup's proposals for free at every step, a model drafter's when offered."""

    def __init__(self, drafter: Drafter, depth: int):
        self.drafter = drafter
        self.depth = depth
        self.start = 0
        self.proposal: list[int] = []
        self.queued: Draft | None = None  # a model drafter's proposal, read when tokens pass it

    def offer(self, tokens: list[int], proposal: Draft) -> None:
        """A model drafter's proposal to follow TOKENS, to be checked as the plain tokens come
        (read from the device then, not now)."""
        self.proposal, self.queued, self.start = [], proposal, len(tokens)

    def update(self, tokens: list[int]) -> tuple[int, int] | None:
        """Call after tokens grew; returns (drafted, accepted) when a proposal is settled."""
        settled = None
        if self.queued is not None:
            if len(tokens) <= self.start:
                return None
            self.proposal, self.queued = list(self.queued.host_tokens()), None
        if self.proposal:
            got = tokens[self.start : self.start + len(self.proposal)]
            matched = 0
            while matched < len(got) and got[matched] == self.proposal[matched]:
                matched += 1
            if matched < len(got) or len(got) == len(self.proposal):
                settled = (len(self.proposal), matched)
                self.proposal = []
        if not self.proposal:
            self.proposal = self.drafter.lookup(tokens, self.depth)
            self.start = len(tokens)
        return settled

    def pending(self, tokens: list[int]) -> tuple[int, int] | None:
        """(drafted, matched) of a proposal read and matched so far by TOKENS but not yet
        settled; None if there is none (or a model drafter's, not read yet)."""
        if self.queued is not None or not self.proposal:
            return None
        got = tokens[self.start : self.start + len(self.proposal)]
        if len(got) >= len(self.proposal) or got != self.proposal[: len(got)]:
            return None
        return len(self.proposal), len(got)

    def reset(self) -> None:
        self.proposal, self.queued = [], None


class AheadGate:
    """Whether to queue the next verify before the current one is read (pipelining).

    A queued verify guesses that every draft is accepted and what the target and the drafter
    say next; a wrong guess wastes that forward on the GPU. The guess is checked on every
    step, queued or not, so the hit rate is known for free; queue only while it is high.
    """

    ON_AT = 0.7  # a miss costs a verify, a hit saves the host's share of one
    DECAY = 0.8

    def __init__(self):
        self.rate = 0.0

    def observe(self, hit: bool) -> None:
        self.rate = self.DECAY * self.rate + (1.0 - self.DECAY) * float(hit)

    @property
    def on(self) -> bool:
        return self.rate >= self.ON_AT


@dataclass
class Guess:
    """The next verify as guessed before the current one is read: every draft accepted, the
    target's next token ``bonus``, then the drafter's ``drafts``. ``logprobs`` is set when
    that verify was queued on the device (a forward at cache length ``start``)."""

    start: int
    bonus: int
    drafts: list[int]
    logprobs: mx.array | None = None
