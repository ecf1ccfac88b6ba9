"""What shapes a request's target rows beyond its sampling settings: a constraint's masks,
penalties and logit bias, and the logprobs it asked for. One per request, used the same way by
the single-request loop (speculate.py) and a batch row (batch.py).

A request with any of them "reads rows": each row needs the host's tokens before it (its mask,
its penalties) or is read on the host (logprobs), so no step is queued ahead of the last.
"""

from __future__ import annotations

import mlx.core as mx

from .constraints import MaskedChainSampling, TokenConstraint, apply_mask
from .drafters.base import Draft, Drafter
from .logprobs import TokenLogprob, token_logprobs
from .penalties import Penalties
from .sampling import SamplingParams


class RowRules:
    def __init__(self, constraint: TokenConstraint | None = None, penalties: Penalties | None = None,
                 top_logprobs: int | None = None):
        self.constraint = constraint
        self.penalties = penalties if penalties is not None and penalties.active else None
        self.top_logprobs = top_logprobs  # None: no logprobs; n: the chosen token's and n more

    @property
    def reads_rows(self) -> bool:
        return self.constraint is not None or self.top_logprobs is not None or self.penalties is not None

    def draft_sampling(self, sampling: SamplingParams, drafter: Drafter) -> SamplingParams:
        """What a drafter samples its chain with: under a constraint, each draw masked to the
        language (model drafters; host drafters do not sample)."""
        if self.constraint is None or not drafter.uses_model:
            return sampling
        s = sampling
        return MaskedChainSampling(s.temperature, s.top_p, s.top_k, s.min_p, s.keys, constraint=self.constraint)

    def cut(self, draft: Draft) -> tuple[Draft, mx.array | None, mx.array | None]:
        """DRAFT cut at its first token outside the constraint's language, the masks of the
        verify's rows, and the q row of the token cut (None: nothing cut, or a drafter that
        drafts deterministically, whose cut token p already gives 0). No constraint: DRAFT."""
        if self.constraint is None:
            return draft, None, None
        host = draft.host_tokens()
        cut, masks = self.constraint.masks(host)
        if cut == len(draft):
            return draft, masks, None
        q = draft.logprobs
        cut_q = None if q is None else q[cut : cut + 1]
        return Draft(draft.tokens[:cut], None if q is None else q[:cut], host[:cut]), masks, cut_q

    def plain_masks(self) -> mx.array | None:
        """The mask of a plain step's one row (None: no constraint)."""
        return self.constraint.masks([])[1] if self.constraint is not None else None

    def process(self, tokens: list[int], logits: mx.array, drafts: list[int], masks: mx.array | None) -> mx.array:
        """The target's LOGITS (rows after TOKENS and DRAFTS[:i]) as plain decoding samples them:
        penalties and bias, then the constraint's masks."""
        if self.penalties is not None:
            logits = self.penalties.apply(tokens, drafts, logits)
        return logits if masks is None else apply_mask(logits, masks)

    def commit(self, new: list[int], logits: mx.array | None) -> list[TokenLogprob]:
        """NEW tokens were sampled from LOGITS' rows (processed): advance the constraint; their
        logprobs (see logprobs.py for which distribution), [] when none were asked for."""
        if self.constraint is not None:
            self.constraint.advance(new)
        if self.top_logprobs is None:
            return []
        return token_logprobs(logits[: len(new)], new, self.top_logprobs)
