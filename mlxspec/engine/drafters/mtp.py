"""The model's own multi-token-prediction head drafts a chain of tokens.

The head reads pairs (h_t, x_{t+1}): the trunk's final-norm hidden state at position t and the
token that followed, and predicts x_{t+2}. Its KV cache holds one entry per committed pair;
the chain it drafts past them (feeding its own output hidden back) is trimmed after verify.
"""

from __future__ import annotations

import mlx.core as mx

from ...models.mtp.head import MTPHead
from ..cache import model_nbytes
from ..sampling import SamplingParams
from .base import Draft, Drafter, sample_chain


class MTPDrafter(Drafter):
    name = "mtp"
    uses_model = True
    needs_hidden = True

    def __init__(self, head: MTPHead, target_nbytes: int | None = None):
        self.head = head
        # One draft step runs the head's block and an lm_head: the trunk's, unless the head
        # ships its own (NextN shared_head.head, already counted in head.nbytes).
        shared = getattr(getattr(head.module, "shared_head", None), "head", None) is None
        lm_bytes = model_nbytes(getattr(head.trunk.head, "__self__", head.trunk.head)) if shared else 0
        if target_nbytes:
            self.cost_per_token = 0.05 + (head.nbytes + lm_bytes) / target_nbytes
        else:
            self.cost_per_token = 0.1
        self.cache = head.make_cache()
        self.pairs = 0
        self._rows: list[mx.array] = []

    def start(self, prompt: list[int], hidden: mx.array | None = None) -> None:
        self.cache = self.head.make_cache()
        self.pairs = 0  # committed pairs in the head's cache: (h_t, x_{t+1}) for t < pairs
        self._rows = [hidden] if hidden is not None and hidden.shape[0] else []

    def add_hidden(self, rows: mx.array) -> None:
        self._rows.append(rows)

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> Draft | None:
        last = len(tokens) - 1  # tokens[last] is sampled, not yet fed to the trunk
        need = last - self.pairs
        if k <= 0 or need <= 0 or not self._rows:
            return None
        rows = mx.concatenate(self._rows) if len(self._rows) > 1 else self._rows[0]
        if rows.shape[0] < need:
            return None
        # Commit the new pairs t = pairs .. last-1 (one forward), then chain k drafts.
        new_tokens = mx.array(tokens[self.pairs + 1 : last + 1], mx.uint32)
        logits, hid = self.head.step(new_tokens, rows[:need], self.cache)
        self.pairs = last
        self._rows = [rows[need:]] if rows.shape[0] > need else []
        last_hidden = [hid[-1:]]  # the head's own output feeds the next chain step

        def step(i, tok):
            logits, last_hidden[0] = self.head.step(tok, last_hidden[0], self.cache, step=i)
            return logits

        return sample_chain(logits[-1:], k, sampling, step)

    def rollback(self, committed: int) -> None:
        # Only the chain is speculative: keep the committed pairs.
        for c in self.cache:
            c.trim(c.offset - self.pairs)
