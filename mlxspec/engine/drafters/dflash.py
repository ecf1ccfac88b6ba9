"""A DFlash block drafter proposes a whole block of tokens in one forward.

Terms:
- context: the target's features (outputs of layers ``target_layer_ids``, one row per position
  the target has fed) turned into keys/values in each draft layer; only committed positions
  are ever added, so a rejected draft leaves nothing to roll back.
- block: ``[last token, MASK x (B-1)]`` at positions ``len(tokens)-1 ..``; the drafter's
  final hidden at block position i (1..B-1) gives q_i, the distribution of the token i places
  after the last one. q_i does not depend on the tokens drafted before position i (the block
  holds masks there), so each position is drawn independently from its own q_i, and
  Leviathan/Chen acceptance against that q_i is exact (sampling.accept_sampled).
- The checkpoint's full block always runs (its trained input) and the first k positions are
  drafted: a step costs the same at every depth (``cost_per_step``), and one input shape.
- Long contexts: past ``sink + window`` positions, the middle of the context is dropped (the
  first ``sink`` and the last ``window`` kept, RoPE positions unchanged), which bounds the
  drafter's attention; the target, and so exactness, is untouched.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...models.dflash import DFlashDraftModel
from ...models.trunk import split_trunk
from ..cache import merged_caches, model_nbytes, restore_caches, snapshot_caches
from ..sampling import SamplingParams
from ..tree import tree_from_marginals
from .base import Draft, Drafter, joined_rows

DEFAULT_SINK = 64
DEFAULT_WINDOW = 4096


class DFlashDrafter(Drafter):
    name = "dflash"
    uses_model = True
    needs_hidden = True
    trees_by_default = True  # its block gives every position's distribution at once
    drafts_together = True  # a batch's rows: one block forward for all (propose_together)

    def __init__(self, model: DFlashDraftModel, target: nn.Module, target_nbytes: int | None = None,
                 cost_per_step: float | None = None, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW):
        self.model = model
        trunk = split_trunk(target)
        self.embed, self.head = trunk.embed, trunk.head
        self.capture_layers = tuple(model.args.target_layer_ids)
        self.block = model.block_size
        self.depth_cap = self.block - 1
        self.mask_id = model.args.mask_token_id
        self.sink, self.window = sink, window
        if cost_per_step is not None:
            self.cost_per_step = cost_per_step
        elif target_nbytes:  # a block forward streams the drafter's weights and the lm_head
            lm = model_nbytes(getattr(trunk.head, "__self__", trunk.head))
            self.cost_per_step = 0.05 + (model_nbytes(model) + lm) / target_nbytes
        else:
            self.cost_per_step = 0.2
        self.cost_per_token = 0.0
        self.start([])

    # -- context -------------------------------------------------------------------
    def start(self, prompt: list[int], resume=None, at: int = 0) -> None:
        self.cache = self.model.make_cache()
        self.position = 0  # next context position (context rows 0..position-1 are in the cache or dropped)
        self.dropped = 0  # middle positions dropped by the window
        self._rows: list[mx.array] = []  # features of positions position.. not in the cache yet
        if resume is not None and self.resume_point(resume, at) == at:
            snap, stored, rows = resume
            keep = min(stored, at)
            if keep:
                restore_caches(self.cache, snap, keep)
            self.position = keep
            if at > keep:
                self._rows = [rows[: at - keep]]
        elif at:
            # a cached prefix without this drafter's context: drafts see less history, the
            # positions stay right
            self.position = self.dropped = at

    def resume_point(self, resume, at: int) -> int:
        if resume is None:
            return at
        _, stored, rows = resume
        return at if stored + (0 if rows is None else rows.shape[0]) >= at else 0

    def prefill(self, prompt: list[int], upto: int, hidden: mx.array | None = None) -> None:
        if hidden is not None and hidden.shape[0]:
            self._rows.append(hidden)
            self._commit()
            mx.eval([c.state for c in self.cache])

    def add_hidden(self, rows: mx.array) -> None:
        self._rows.append(rows)

    def snapshot(self):
        if self.dropped or (self.position == 0 and not self._rows):
            return None
        snap = snapshot_caches(self.cache, self.position) if self.position else None
        if self.position and snap is None:
            return None
        rows = self._pending()
        if rows is not None:
            mx.eval(rows)
        return snap, self.position, rows

    def _pending(self) -> mx.array | None:
        return joined_rows(self._rows)

    def _commit(self) -> None:
        """Turn the pending features into context keys/values, then bound the context."""
        rows = self._pending()
        if rows is None:
            return
        self.model.add_context(rows, self.cache, self.position)
        self.position += rows.shape[0]
        self._rows = []
        stored = self.cache[0].offset
        if stored > self.sink + self.window + self.window // 4:  # cut in steps, not every token
            cut = stored - self.sink - self.window
            for c in self.cache:
                keep = slice(self.sink + cut, stored)
                c.keys = mx.concatenate([c.keys[..., : self.sink, :], c.keys[..., keep, :]], axis=2)
                c.values = mx.concatenate([c.values[..., : self.sink, :], c.values[..., keep, :]], axis=2)
                c.offset = self.sink + self.window
            self.dropped += cut

    # -- drafting ------------------------------------------------------------------
    def block_logits(self, tokens: list[int], k: int) -> mx.array | None:
        """Logits (k, V) of block positions 1..k (k at most the block less one) after ``tokens``
        (its last one not fed to the target yet), or None while the context lags (no features
        yet for some position)."""
        k = min(k, self.block - 1)
        if not self._context_ready(tokens, k):
            return None
        self._commit()
        h = self.model(self.embed(self._block(tokens))[None], self.cache, len(tokens) - 1)
        return self.block_rows(tokens, self.head(h[:, 1 : k + 1])[0])

    def block_rows(self, tokens: list[int], logits: mx.array) -> mx.array:
        """What block positions 1..k draft from, given the block's LOGITS (k, V) after TOKENS:
        those logits (a bench's steered drafter puts its script's rows in their place)."""
        return logits

    def _context_ready(self, tokens: list[int], k: int) -> bool:
        """Whether a block can follow TOKENS: the features of every position but the last one
        are in (cached or pending)."""
        rows = self._pending()
        return k > 0 and self.position + (0 if rows is None else rows.shape[0]) == len(tokens) - 1

    def _block(self, tokens: list[int]) -> mx.array:
        return mx.array([tokens[-1]] + [self.mask_id] * (self.block - 1), mx.uint32)

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> Draft | None:
        logits = self.block_logits(tokens, k)
        return None if logits is None else self._draft(logits, sampling)

    @classmethod
    def propose_together(cls, drafters, tokens, ks, samplings):
        """The rows' blocks in one forward: each row adds its own pending context, then the
        blocks run as a batch over the rows' contexts merged left-padded (each row at its own
        positions, its padding masked); row i drafts its first ks[i] positions from its rows,
        as :meth:`propose` does. The merged cache is dropped (a block's own keys are never
        kept). Fewer than two rows ready, or rows of other drafter models: each :meth:`propose`."""
        depth = [min(k, d.block - 1) for d, k in zip(drafters, ks, strict=True)]
        live = [i for i, (d, t, k) in enumerate(zip(drafters, tokens, depth)) if d._context_ready(t, k)]
        model = drafters[live[0]].model if live else None
        if len(live) < 2 or any(drafters[i].model is not model for i in live):
            return super().propose_together(drafters, tokens, ks, samplings)
        first = drafters[live[0]]
        for i in live:
            drafters[i]._commit()
        blocks = mx.stack([first._block(tokens[i]) for i in live])  # (B, S)
        positions = mx.array([len(tokens[i]) - 1 for i in live])
        merged = merged_caches([drafters[i].cache for i in live])
        h = model.forward_rows(first.embed(blocks), merged, positions)  # (B, S, H)
        logits = first.head(h[:, 1 : 1 + max(depth[i] for i in live)])  # (B, k, V)
        drafts: list[Draft | None] = [None] * len(drafters)
        for j, i in enumerate(live):
            drafts[i] = drafters[i]._draft(drafters[i].block_rows(tokens[i], logits[j, : depth[i]]), samplings[i])
        return drafts

    def _draft(self, logits: mx.array, sampling: SamplingParams) -> Draft:
        """The draft from the block's LOGITS (k, V): each position drawn from its own row."""
        if type(sampling) is SamplingParams:  # every position at once, each from its own q_i
            drafted, lp = sampling.sample_with_logprobs(logits)
        else:  # a chain sampler (constraint masks follow the drafts): one row at a time
            pairs = [sampling.sample_with_logprobs(logits[i : i + 1]) for i in range(logits.shape[0])]
            drafted = mx.concatenate([t.reshape(-1) for t, _ in pairs])
            lp = mx.concatenate([p for _, p in pairs])
        return Draft(drafted.astype(mx.uint32), None if sampling.greedy else lp, rows=lp)

    def propose_tree(self, tokens: list[int], k: int, budget: int, sampling: SamplingParams):
        """A tree over the block's per-position distributions (q_i does not depend on the
        tokens before position i, so every prefix's children come from the same row):
        top-k children best-first at temperature 0 (DDTree), children drawn i.i.d. from q_i
        above it (checked with SpecInfer's rule)."""
        logits = self.block_logits(tokens, k)
        if logits is None:
            return None
        return tree_from_marginals(sampling.logprobs(logits), budget, sampled=not sampling.greedy,
                                   key=sampling.draw_key())
