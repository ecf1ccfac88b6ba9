"""Penalties and logit bias: mlx-lm's logits processors, applied to every row the target is
sampled from, plain or verify alike.

A processor reads the tokens before the row it shapes (prompt and output, as in
``mlx_lm.generate_step``). In a verify of k drafts, row i comes after the committed tokens and
drafts 1..i, so each row is processed with its own history: the distribution acceptance uses
at position i is the one plain decoding would sample from had drafts 1..i been committed, and
speculation stays exact (Leviathan/Chen only needs p_i to be plain sampling's distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ..options import DEFAULT_PENALTY_WINDOW


@dataclass(frozen=True)
class Penalties:
    """What shapes the target's logits before sampling. ``repetition``: multiplicative, sign-aware
    (1 or None off); ``presence`` / ``frequency``: subtracted once / once per occurrence;
    each counts the last ``window`` tokens. ``logit_bias``: (token id, added logit) pairs."""

    repetition: float | None = None
    presence: float = 0.0
    frequency: float = 0.0
    window: int = DEFAULT_PENALTY_WINDOW
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def repetition_on(self) -> float | None:
        """The repetition penalty when it changes anything (None: absent or 1)."""
        return self.repetition if self.repetition not in (None, 1.0) else None

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.presence != 0 or self.frequency != 0 or self.repetition_on is not None

    @cached_property
    def processors(self) -> list:
        """mlx-lm's processors for these values (empty when none is active)."""
        if not self.active:
            return []
        return make_logits_processors(
            dict(self.logit_bias) or None, self.repetition_on, self.window,
            self.presence or None, self.window, self.frequency or None, self.window,
        )

    def check_vocabulary(self, size: int) -> None:
        """ValueError naming the first biased token id outside a vocabulary of SIZE."""
        check_token_ids([token for token, _ in self.logit_bias], size)

    def apply(self, history: list[int], drafts: list[int], logits: mx.array) -> mx.array:
        """LOGITS (rows, V), rows <= len(DRAFTS) + 1, with row i processed after HISTORY (the
        committed tokens) and DRAFTS[:i]."""
        rows = logits.shape[0]
        assert rows <= len(drafts) + 1, (rows, len(drafts))
        if not self.processors:
            return logits
        out = []
        for i in range(rows):
            tokens = mx.array((history[-self.window :] + drafts[:i])[-self.window :], mx.uint32)
            row = logits[i : i + 1]
            for process in self.processors:
                row = process(tokens, row)
            out.append(row)
        return mx.concatenate(out) if rows > 1 else out[0]


def check_token_ids(tokens, size: int, what: str = "logit_bias") -> None:
    """ValueError naming the first of TOKENS outside a vocabulary of SIZE (WHAT: where they came from)."""
    for token in tokens:
        if not 0 <= token < size:
            raise ValueError(f"{what} token id {token} is outside the vocabulary (0 to {size - 1})")
