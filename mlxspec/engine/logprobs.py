"""Per-token log-probabilities for the answer (OpenAI ``logprobs`` / ``top_logprobs``).

Which distribution: the log-softmax of the target's logits for that position after the
constraint mask (if any) and before temperature, top-p, top-k and min-p: what mlx-lm's
``stream_generate`` reports (logits processors applied, sampler not) and what OpenAI reports
(the model's, not the sampler's). Speculation reads them from the target's own verify rows,
plain decoding from its one row: the same numbers, to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, its log-probability and, when asked for, the ``top`` n
    most likely tokens at its position as (id, logprob), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """TokenLogprobs of TOKENS, one per row of LOGITS (rows, V): the chosen token's and the
    TOP most likely (0: none)."""
    rows = logits.astype(mx.float32)
    lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens, mx.int32)[:, None], axis=-1)[:, 0]
    if top <= 0:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen.tolist())]
    top = min(top, lp.shape[-1])
    ids = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
    vals = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    return [TokenLogprob(t, v, list(zip(i, p)))
            for t, v, i, p in zip(tokens, chosen.tolist(), ids.tolist(), vals.tolist())]
