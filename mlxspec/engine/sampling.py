"""Sampling: the processed distribution plain decoding samples from, and exact acceptance.

The filters are mlx-lm's own (``apply_top_p``, ``apply_min_p``, ``apply_top_k`` applied to
log-probabilities in that order, then temperature), so target and draft rows are processed
exactly as ``mlx_lm.sample_utils.make_sampler`` processes the single row of plain decoding.

Acceptance is done on device for all draft positions at once; the host reads back one small
array per verify step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..options import (
    DEFAULT_MIN_P,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    GREEDY_TEMPERATURE,
    MIN_TOP_P,
    check_values,
)


class RandomKeys:
    """One request's random stream: every draw gets a key split off it, so no request touches
    MLX's global generator (a seeded request would otherwise make the unseeded ones after it
    repeat, and two at once would interleave). Seeded: reproducible from SEED alone; unseeded:
    the first key is drawn from the global generator (random per process, and what a caller's
    ``mx.random.seed`` fixes)."""

    def __init__(self, seed: int | None = None):
        self.seeded = seed is not None  # its draws repeat from run to run
        if seed is not None:
            self.key = mx.random.key(seed)
        else:
            self.key = mx.random.randint(0, 2**31 - 1, shape=(2,)).astype(mx.uint32)

    def draw(self) -> mx.array:
        """A fresh key for one draw (lazy: nothing is evaluated here)."""
        self.key, sub = mx.random.split(self.key)
        return sub


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    min_p: float = DEFAULT_MIN_P
    # the request's random stream (None: MLX's global generator); not part of the value
    keys: RandomKeys | None = field(default=None, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        # a vanishing temperature or top_p too (see options): both keep the top token only
        return self.temperature < GREEDY_TEMPERATURE or self.top_p < MIN_TOP_P

    @property
    def seeded(self) -> bool:
        """Whether these draws come from a seeded stream (a request whose draws must repeat)."""
        return self.keys is not None and self.keys.seeded

    def for_request(self, seed: int | None) -> SamplingParams:
        """These parameters with a random stream of their own (see RandomKeys)."""
        return replace(self, keys=RandomKeys(seed))

    def draw_key(self) -> mx.array | None:
        """The key for the next draw (None: the global generator; or greedy, which draws nothing)."""
        return self.keys.draw() if self.keys is not None and not self.greedy else None

    def validate(self) -> None:
        """UsageError for a value out of range (mlxspec.options holds the limits)."""
        check_values({"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                      "min_p": self.min_p})

    def logprobs(self, logits: mx.array) -> mx.array:
        """Normalized log-probabilities of the distribution plain sampling draws from, per row."""
        if logits.shape[0] == 1:
            # mlx-lm's exact ops for its one row: in bf16 another reduction kernel can round
            # the normalizer differently and break a near-tie the other way.
            lp = logits - mx.logsumexp(logits, keepdims=True)
        else:
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.greedy:
            return lp
        if 0.0 < self.top_p < 1.0:
            lp = apply_top_p(lp, self.top_p)
        if self.min_p != 0.0:
            lp = apply_min_p(lp, self.min_p)
        if 0 < self.top_k < lp.shape[-1]:
            lp = apply_top_k(lp, self.top_k)
        scaled = lp * (1.0 / self.temperature)
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)

    def sample(self, logits: mx.array) -> mx.array:
        """One token per row, as plain decoding would draw it."""
        lp = self.logprobs(logits)
        if self.greedy:
            return mx.argmax(lp, axis=-1)
        return mx.random.categorical(lp, key=self.draw_key())

    def sample_with_logprobs(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Sampled tokens and the processed log-probabilities they were drawn from (for q)."""
        lp = self.logprobs(logits)
        tok = mx.argmax(lp, axis=-1) if self.greedy else mx.random.categorical(lp, key=self.draw_key())
        return tok, lp


def _leading_true(mask: mx.array) -> mx.array:
    """Number of leading True values (the accepted prefix length)."""
    return mx.cumprod(mask.astype(mx.int32)).sum()


def accept_greedy(target_logprobs: mx.array, draft: mx.array) -> tuple[mx.array, mx.array]:
    """Temperature 0: accept while the target's argmax equals the draft.

    target_logprobs: (k+1, V); draft: (k,). Returns (n_accepted, tokens) where ``tokens[n]``
    is the target's own token after the accepted prefix (correction or bonus).
    """
    tokens = mx.argmax(target_logprobs, axis=-1)
    return _leading_true(tokens[:-1] == draft), tokens


def accept_sampled(
    target_logprobs: mx.array, draft: mx.array, draft_logprobs: mx.array | None,
    cut_logprobs: mx.array | None = None, key: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Leviathan/Chen speculative sampling, exact in distribution.

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first reject
    draw from norm(max(p_i - q_i, 0)); if all k are accepted draw a bonus token from p_k.
    ``draft_logprobs`` None means a deterministic drafter (q = one-hot on the draft token),
    for which the ratio is p_i(x_i) and the residual is p_i with x_i removed.
    ``cut_logprobs`` (1, V): the q of a drafted token dropped after DRAFT before the verify
    (outside a constraint, so p_k gives it 0 and it would be rejected for sure): the token
    after a fully accepted DRAFT is then drawn from that rejection's residual instead of p_k.

    ``key``: the draws' key (None: MLX's global generator).

    Returns (n_accepted, tokens) with ``tokens[n]`` the token that follows the accepted prefix.
    """
    k_u, k_c, k_b = mx.random.split(key, 3) if key is not None else (None, None, None)
    k = draft.shape[0]
    p = mx.exp(target_logprobs)
    last = target_logprobs[k:]
    if cut_logprobs is not None:
        last = _residual_logprobs(p[k:], mx.exp(cut_logprobs))
    if k == 0:
        return mx.array(0), mx.random.categorical(last, key=k_b)
    p_draft = p[:k]
    px = mx.take_along_axis(p_draft, draft[:, None], axis=-1)[:, 0]
    if draft_logprobs is None:
        ratio = px
        residual = mx.put_along_axis(p_draft, draft[:, None], mx.array(0.0, p.dtype), axis=-1)
    else:
        q = mx.exp(draft_logprobs)
        qx = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
        ratio = px / mx.maximum(qx, 1e-30)
        residual = mx.maximum(p_draft - q, 0.0)
    u = mx.random.uniform(shape=(k,), key=k_u)
    n = _leading_true(u < ratio)
    # A residual of all zeros happens only where p == q, where a reject has probability 0;
    # fall back to p there so the (unused) draw stays well defined.
    has_mass = residual.sum(axis=-1, keepdims=True) > 0
    residual = mx.where(has_mass, residual, p_draft)
    corrections = mx.random.categorical(mx.log(residual), key=k_c)
    bonus = mx.random.categorical(last, key=k_b)
    return n, mx.concatenate([corrections, bonus])


def _residual_logprobs(p: mx.array, q: mx.array) -> mx.array:
    """log norm(max(p - q, 0)) per row, p itself where that is empty (p == q)."""
    residual = mx.maximum(p - q, 0.0)
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    return mx.log(residual)


def accept(
    params: SamplingParams,
    target_logprobs: mx.array,
    draft: mx.array,
    draft_logprobs: mx.array | None = None,
    cut_logprobs: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Exact acceptance of DRAFT against TARGET_LOGPROBS (k + 1 rows); ``cut_logprobs`` as in
    :func:`accept_sampled` (at temperature 0 a dropped token needs nothing: argmax never
    picks a masked one). An empty DRAFT is a plain step: (0, the target's own token)."""
    if params.greedy:
        if draft.shape[0] == 0:
            return mx.array(0), mx.argmax(target_logprobs, axis=-1)
        return accept_greedy(target_logprobs, draft)
    return accept_sampled(target_logprobs, draft, draft_logprobs, cut_logprobs, key=params.draw_key())
