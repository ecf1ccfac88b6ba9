"""A request's prompt into its target cache: the longest cached prefix restored, the rest fed
in chunks (target and drafter together), the caches kept at the request's checkpoints. One
way for the single-request loop (speculate.py) and a batch row (batch.py)."""

from __future__ import annotations

from typing import Iterator, Sequence

from .cache import ModelState, Snapshot
from .drafters.base import Drafter
from .prefix_cache import PrefixCache


def store(prefix_cache: PrefixCache, tokens: list[int], snapshot: Snapshot | None, drafter: Drafter | None) -> None:
    """Keep SNAPSHOT (the target's cache over TOKENS) and DRAFTER's state with it, for a later
    request that shares them."""
    prefix_cache.store(tokens, snapshot, drafter.name if drafter else None, drafter.snapshot() if drafter else None)


def restore_prefix(state: ModelState, prompt: list[int], drafter: Drafter | None,
                   prefix_cache: PrefixCache | None) -> int:
    """Load the longest cached prefix of PROMPT (but its last token, which the first decoding
    step feeds) that STATE and DRAFTER can start from into the fresh STATE, and start DRAFTER
    on PROMPT; returns that prefix's length (0: nothing cached)."""
    at, resume = 0, None
    found = prefix_cache.lookup(prompt, len(prompt) - 1) if prefix_cache is not None else None
    if found is not None:
        entry, at = found
        if drafter is not None:
            resume = entry.drafters.get(drafter.name)
            at = drafter.resume_point(resume, at)
        if at > 0:
            state.restore(entry.target, at)
    if drafter is not None:
        drafter.start(prompt, resume if at else None, at)
    return at


def feed_prompt(state: ModelState, prompt: list[int], drafter: Drafter | None, prefix_cache: PrefixCache | None,
                checkpoints: Sequence[int], step: int) -> Iterator[int]:
    """Feed PROMPT past what STATE holds (but its last token) in chunks of STEP tokens, the
    drafter along; yields the tokens fed after each chunk. The caches are stored at each
    checkpoint inside that span and at its end."""
    at, end = state.length, len(prompt) - 1
    for point in sorted({p for p in checkpoints if at < p < end} | {end}):
        while state.length < point:
            n = min(step, point - state.length)
            hidden = state.prefill(prompt[state.length : state.length + n], step=n)
            if drafter is not None:
                drafter.prefill(prompt, state.length, hidden)
            yield state.length
        if prefix_cache is not None and state.length > at:
            store(prefix_cache, prompt[: state.length], state.snapshot(), drafter)
