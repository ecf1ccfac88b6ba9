"""The speculative loop: draft k tokens, verify k+1 positions in one target forward, keep the
accepted prefix plus the target's own next token, roll every cache back to what was kept.

When no draft is worth making, it decodes plainly with mlx-lm's pipelining (the next step is
queued with ``mx.async_eval`` before the current token is read), so speculation off costs
nothing over ``mlx_lm.stream_generate``.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit

from ..errors import DrafterError, UsageError
from ..models.mtp.head import MTPHead
from ..options import DEFAULT_MAX_DEPTH, FALLBACK_MAX_DEPTH, check_values
from .cache import ModelState
from .constraints import TokenConstraint
from .drafters.base import Drafter
from .drafters.pld import repetition_score
from .drafters.registry import make_drafter
from .emit import Output
from .gates import AheadGate, CostModel, Guess, ShadowDrafts, SpeculationGate, probe, stays_plain
from .logprobs import TokenLogprob
from .penalties import Penalties
from .prefill import feed_prompt, restore_prefix, store
from .prefix_cache import PrefixCache
from .row_rules import RowRules
from .sampling import SamplingParams, accept
from .stats import Stats
from .tree_step import TreePolicy, TreeUnsupported, tree_step


class SpeculativeDecoder:
    """Generates from ``model`` with an optional drafter; exact at any temperature."""

    def __init__(
        self,
        model: nn.Module,
        *,
        draft_model: nn.Module | None = None,
        mtp_head: MTPHead | None = None,
        drafter: str | Drafter = "auto",
        depth: int | None = None,
        max_depth: int | None = None,
        gates: bool = True,
        cost: CostModel | None = None,
        draft_cost: float | None = None,
        tree: int | None | str = "default",
    ):
        """``cost``: the target's measured verify cost; ``draft_cost``: the measured cost of
        one step of the drafter named by DRAFTER (a Drafter brings its own). ``tree``: draft
        trees of at most that many nodes, 0 none, None chosen from the cost curve; "default"
        is the drafter's own default (DFlash: chosen; others: none)."""
        self.model = model
        self.drafter = drafter if isinstance(drafter, Drafter) else make_drafter(
            drafter, model, draft_model, mtp_head, draft_cost
        )
        check_values({"depth": depth})
        self.depth = depth
        default_max = DEFAULT_MAX_DEPTH.get(getattr(self.drafter, "name", ""), FALLBACK_MAX_DEPTH)
        self.max_depth = max_depth or depth or default_max
        cap = getattr(self.drafter, "depth_cap", None)  # a block drafter drafts its block at most
        if cap:
            self.max_depth = min(self.max_depth, cap)
            self.depth = min(depth, cap) if depth else depth
        self.gates = gates
        self.cost = cost
        if tree == "default":
            tree = None if getattr(self.drafter, "trees_by_default", False) else 0
        self.tree = tree

    def generate(
        self,
        prompt: list[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        max_tokens: int = 256,
        stop_tokens: set[int] | frozenset[int] = frozenset(),
        seed: int | None = None,
        prefix_cache: PrefixCache | None = None,
        checkpoints: Sequence[int] = (),
        prefill_step: int = 2048,
        on_prefill: Callable[[int, int], None] | None = None,
        constraint: TokenConstraint | None = None,
        logprobs: int | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
        penalties: Penalties | None = None,
    ) -> Iterator[tuple[list[int], Stats]]:
        """Yield (new tokens, running stats) as tokens are committed.

        With ``prefix_cache``, the longest cached prefix of the prompt is restored instead of
        prefilled, and the caches are stored at each of ``checkpoints`` (prompt positions a
        later request may share, e.g. the end of the conversation before the generation
        prompt), at the end of the prompt and at the end of the answer. The prompt is fed in
        chunks of ``prefill_step`` tokens; ``on_prefill(done, total)`` follows it.

        ``constraint``: every sampled row is masked to its language (plain and verify rows
        alike), drafts are cut where they leave it. ``logprobs`` (0..20, None off): before each
        yield, ``on_logprobs`` gets one TokenLogprob per yielded token. ``penalties``: mlx-lm's
        logits processors on every target row, each after its own history (penalties.py).

        ``seed``: the request's random stream starts from it (None: a fresh one); MLX's global
        generator is never reseeded."""
        if not prompt:
            raise UsageError("the prompt is empty")
        if prefill_step < 1:
            raise UsageError(f"prefill_step must be at least 1 (got {prefill_step})")
        sampling = sampling.for_request(seed)  # its own random stream: no global seed
        run = _Run(self, list(prompt), sampling, max_tokens, set(stop_tokens), prefix_cache=prefix_cache,
                   checkpoints=checkpoints, prefill_step=prefill_step, on_prefill=on_prefill)
        run.rules, run.on_logprobs = RowRules(constraint, penalties, logprobs), on_logprobs
        if run.rules.reads_rows:
            # each row follows the tokens before it on the host (its mask, its penalties): no
            # queued plain step or verify
            run.ahead = None
        with wired_limit(self.model, [generation_stream]), mx.stream(generation_stream):
            yield from run.loop()


class _Run:
    """State of one request."""

    def __init__(self, dec: SpeculativeDecoder, prompt, sampling, max_tokens, stop_tokens, *,
                 prefix_cache: PrefixCache | None = None, checkpoints: Sequence[int] = (),
                 prefill_step: int = 2048, on_prefill: Callable[[int, int], None] | None = None):
        self.sampling = sampling
        self.tokens = prompt  # committed; the last one is not fed to the target yet
        self.drafter = dec.drafter
        self.hidden_to_drafter = self.drafter is not None and self.drafter.needs_hidden
        capture = self.drafter.capture_layers if self.hidden_to_drafter else None
        self.target = ModelState(dec.model, keep_hidden=self.hidden_to_drafter, capture=capture)
        if self.drafter is not None:
            self.drafter.bind_target(self.target)
        self.stats = Stats(prompt_tokens=len(prompt))
        self.output = Output(self.stats, max_tokens, stop_tokens)
        self.gate = self.shadow = None
        if self.drafter is not None:
            try:
                self.target.check_rollback()
            except DrafterError as err:
                self.stats.record_gate(False, str(err))
                self.drafter = None
                self.hidden_to_drafter = False
        self.stats.drafter = self.drafter.name if self.drafter else "none"
        if self.drafter is not None:
            self.gate = SpeculationGate(
                self.drafter, dec.max_depth, dec.cost, fixed_depth=dec.depth, enabled=dec.gates
            )
            self.stats.depth = self.gate.max_depth
            self.stats.cost_model = "measured" if self.gate.cost.measured else "default"
            self.shadow = ShadowDrafts(self.drafter, self.gate.max_depth)
        self.trees = None
        if self.drafter is not None and dec.tree != 0:
            self.trees = TreePolicy.for_target(dec.tree, self.gate.cost, self.target.recurrent)
        # Pipelining: host drafters can guess the next verify before this one is read
        self.ahead = AheadGate() if self.drafter is not None and not self.drafter.uses_model else None
        self.guess: Guess | None = None
        self.prefix_cache = prefix_cache
        self.checkpoints = checkpoints
        self.prefill_step = prefill_step
        self.on_prefill = on_prefill
        self.rules = RowRules()  # constraint, penalties, logprobs (generate sets them)
        self.on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
        self.step_logprobs: list[TokenLogprob] = []

    def _sync_gate(self) -> None:
        self.gate.flush(self.stats.record_gate)

    # -- the loop -------------------------------------------------------------------
    def loop(self):
        self._prefill()
        if self.drafter is not None:
            if not self.drafter.uses_model:
                self.gate.prompt_check(repetition_score(self.tokens))
            self._sync_gate()
        pending = None  # a plain step in flight: tokens[-1] was fed, its successor is sampled
        try:
            while not self.output.done:
                remaining = self.output.remaining
                draft = new = None
                if self.drafter is not None:
                    self.gate.at_context(len(self.tokens))
                if pending is None and remaining > 1 and self.drafter is not None:
                    k = min(self.gate.depth(), remaining - 1)
                    self._sync_gate()
                    new = self._tree(k) if k > 0 else None  # a tree step, where one pays
                    if k > 0 and new is None:
                        sampling = self.rules.draft_sampling(self.sampling, self.drafter)
                        draft = self.drafter.propose(self.tokens, k, sampling)
                    elif k == 0:
                        self._probe(self.gate.probe_depth())
                elif pending is not None and remaining > 1 and self.drafter is not None and self.gate.probes_in_flight:
                    self._probe(self.gate.probe_depth())  # a due probe, queued behind the step in flight
                if new is None and draft is not None:
                    new = self._speculative_step(draft)
                elif new is None:
                    self._settle_guess(None)
                    new, pending = self._plain_step(pending, remaining)
                out = self.output.take(new)
                if self.on_logprobs is not None:
                    self.on_logprobs(self.step_logprobs[: len(out)])
                yield out, self.stats
        except GeneratorExit:  # closed at a yield: every cache holds committed tokens only
            self._settle_guess(None)
            self._store()
            raise
        finally:
            self.target.close()
        self._settle_guess(None)
        self._store()

    # -- the prompt -----------------------------------------------------------------
    def _prefill(self) -> None:
        """Restore the longest cached prefix of the prompt, then feed the rest in chunks
        (target and drafter together), storing the caches at each checkpoint."""
        prompt, drafter = self.tokens, self.drafter
        end = len(prompt) - 1  # the last prompt token is fed by the first decoding step
        at = self.stats.cached_tokens = restore_prefix(self.target, prompt, drafter, self.prefix_cache)
        for pos in feed_prompt(self.target, prompt, drafter, self.prefix_cache, self.checkpoints, self.prefill_step):
            if self.on_prefill is not None:
                self.on_prefill(pos - at, end - at)

    def _store(self) -> None:
        """Keep the caches over the tokens fed so far for a later request that shares them."""
        if self.prefix_cache is None or self.target.length == 0:
            return
        store(self.prefix_cache, self.tokens[: self.target.length], self.target.snapshot(), self.drafter)

    def _pass_hidden(self, rows) -> None:
        """Hand the drafter the hidden states of newly committed positions (MTP heads)."""
        if self.hidden_to_drafter:
            self.drafter.add_hidden(rows)

    @property
    def _reads_rows(self) -> bool:
        """Whether each step's rows need the host's tokens before them or are read there
        (constraint masks, penalties, logprobs): such steps are not queued ahead."""
        return self.rules.reads_rows

    def _commit_rows(self, new: list[int], logits: mx.array) -> None:
        self.step_logprobs = self.rules.commit(new, logits)

    def _read_plain_token(self) -> int:
        """A plain step whose row is read: processed, sampled, its logprobs kept; not pipelined
        (the next row's mask and penalties need this token)."""
        logits = self.target.forward(mx.array(self.tokens[-1:], mx.uint32), rollback=False)[-1:]
        self._pass_hidden(self.target.hidden)
        logits = self.rules.process(self.tokens, logits, [], self.rules.plain_masks())
        t = self.sampling.sample(logits).item()
        self._commit_rows([t], logits)
        return t

    def _plain_step(self, pending, remaining):
        if self._reads_rows:
            t, nxt = self._read_plain_token(), None
        else:
            t, nxt = self._pipelined_token(pending, remaining)
        self.tokens.append(t)
        self.stats.plain_steps += 1
        if self.gate is not None:
            self.gate.after_plain(self.shadow, self.tokens)
        return [t], nxt

    def _pipelined_token(self, pending, remaining):
        """The in-flight token (sampled now if none), with the next plain step queued behind it
        when the next step will be plain too."""
        sample = self.sampling.sample
        if pending is None:
            y = mx.array(self.tokens[-1:], mx.uint32)
            pending = sample(self.target.forward(y, rollback=False)[-1:])
            self._pass_hidden(self.target.hidden)
            mx.async_eval(pending)
        nxt = None
        if remaining > 1 and stays_plain(self.drafter, self.gate, self.tokens):
            nxt = sample(self.target.forward(pending.astype(mx.uint32), rollback=False)[-1:])
            self._pass_hidden(self.target.hidden)
            mx.async_eval(nxt)
        return pending.item(), nxt

    def _probe(self, k: int) -> None:
        """A model drafter's greedy proposal (no random draw taken), checked against the plain
        tokens that follow instead of verified: gate evidence for one drafter forward."""
        if probe(self.drafter, self.shadow, self.tokens, k):
            self.stats.probes += 1

    def _tree(self, k: int) -> list[int] | None:
        """A tree step when the policy says one pays (see tree_step.py); None: draft a chain."""
        if self.trees is None or self._reads_rows:  # masks, penalties and logprobs follow chains
            return None
        d = self.drafter
        budget = self.trees.budget(k, self.gate.model.expected_tokens(k), d.cost_per_step + k * d.cost_per_token,
                                   self.gate.context)
        self.stats.tree_note = self.trees.unsupported or self.trees.why_chain
        tree = d.propose_tree(self.tokens, k, budget, self.sampling) if budget > k else None
        if tree is None or not len(tree):
            return None
        self._settle_guess(None)
        try:
            out = tree_step(self, tree)
        except TreeUnsupported as err:  # raised before any cache changed: chains from now on
            self.trees.unsupported = self.stats.tree_note = f"this target cannot verify trees: {err}"
            d.rollback(len(self.tokens) - 1)
            return None
        self.trees.observe(out)
        self.tokens.extend(out.new)
        self.stats.record_verify(out.depth, out.accepted)
        self.stats.record_tree(len(tree))
        self.gate.observe(out.depth, out.chain_accepted)
        if self.shadow is not None:
            self.shadow.reset()
        return out.new

    # -- pipelining -------------------------------------------------------------------
    def _settle_guess(self, draft) -> mx.array | None:
        """Score the last guess against the step about to run (``draft``; None: a plain
        step or the end) and return its queued logprobs when it is exactly this verify;
        a queued verify that is not is undone."""
        guess, self.guess = self.guess, None
        if guess is None:
            return None
        hit = draft is not None and guess.start == len(self.tokens) - 1 and guess.drafts == draft.host
        self.ahead.observe(hit)
        if guess.logprobs is None:
            return None
        if hit:
            self.stats.queued_used += 1
            return guess.logprobs
        self._undo_queued(guess)
        return None

    def _undo_queued(self, guess: Guess) -> None:
        self.stats.queued_dropped += 1
        self.target.rollback_to(guess.start)  # undoes that forward alone

    def _guess_next(self, draft, k: int) -> Guess | None:
        """The verify after this one if every draft is accepted: the drafter's guess of the
        target's next token and of what it will then propose, at the same depth."""
        if self.ahead is None or draft.host is None:
            return None
        k_next = min(k, self.output.remaining - (k + 1) - 1)
        if k_next < 1:
            return None
        found = self.drafter.peek(self.tokens, draft.host, k_next + 1)
        if len(found) < k_next + 1:
            return None
        guess = Guess(self.target.length, found[0], found[1:])
        if self.ahead.on:
            # Only the forward is queued: the acceptance draws (random at temperature > 0)
            # are made once the guess is confirmed, in the same order as without queueing.
            inputs = mx.array(found, mx.uint32)
            guess.logprobs = self.sampling.logprobs(self.target.forward(inputs, whole=True))
        return guess

    def _speculative_step(self, draft) -> list[int]:
        drafted = len(draft)  # counted whole: tokens cut by a constraint are rejections
        logits = None
        draft, masks, cut_q = self.rules.cut(draft)
        k = len(draft)
        host_drafts = draft.host_tokens() if self.rules.penalties else []
        start = len(self.tokens) - 1  # committed in the cache (a queued verify may follow)
        logprobs = self._settle_guess(draft)
        if logprobs is None:
            inputs = mx.concatenate([mx.array(self.tokens[-1:], mx.uint32), draft.tokens])
            logits = self.rules.process(self.tokens, self.target.forward(inputs), host_drafts, masks)
            logprobs = self.sampling.logprobs(logits)
        args = (self.sampling, logprobs, draft.tokens, draft.logprobs)
        n_acc, out = accept(*args) if cut_q is None else accept(*args, cut_q)
        mx.async_eval(n_acc, out, draft.tokens)
        guess = self._guess_next(draft, k)
        if guess is not None and guess.logprobs is not None:
            mx.async_eval(guess.logprobs)  # runs while the host reads this step's result
        n = n_acc.item()
        new = draft.tokens.tolist()[:n] + [out[n].item()]
        if self._reads_rows:
            self._commit_rows(new, logits)
        if guess is not None and (n < k or new[-1] != guess.bonus):
            if guess.logprobs is not None:
                self._undo_queued(guess)
            self.ahead.observe(False)
            guess = None
        self.guess = guess
        self._pass_hidden(self.target.hidden[: n + 1] if self.hidden_to_drafter else None)
        if guess is None or guess.logprobs is None:  # else all k were kept, the queued verify too
            self.target.rollback_to(start + 1 + n)
        self.target.commit(start + 1 + n)
        self.drafter.rollback(start + 1 + n)
        self.tokens.extend(new)
        self.stats.record_verify(drafted, n)
        self.gate.observe(drafted, n)
        if self.shadow is not None:
            self.shadow.reset()
        return new
