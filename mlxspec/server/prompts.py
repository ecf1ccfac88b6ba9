"""Prompt work off the event loop: rendering chat templates and tokenizing (a multi-megabyte
body takes seconds) run on a small thread pool, at most ``workers`` at once and ``waiting`` more
in line (then 503, as a full generation queue), so health checks, metrics and streams go on.

Before any of it, a prompt's text is bounded by the model's context: no text longer than the
context times the longest token (in characters) fits, so it is refused without tokenizing it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, TypeVar

from .common import APIError

T = TypeVar("T")


def context_tokens(spec) -> int | None:
    """The model's context (max_position_embeddings), or None when it does not say."""
    n = getattr(getattr(spec, "target", None), "context_length", None)
    return n if isinstance(n, int) and n > 0 else None


def longest_token(tokenizer) -> int | None:
    """Characters (bytes, for byte-level vocabularies) of the longest token; None: unknown."""
    try:
        return max(len(t) for t in tokenizer.get_vocab()) or None
    except Exception:  # a stand-in tokenizer or an odd vocabulary: no bound
        return None


def text_size(value) -> int:
    """Characters in the strings of a JSON-like value (messages, tools)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 0


class PromptWork:
    """Where prompts are rendered and tokenized: a bounded pool, and the size bound."""

    def __init__(self, spec, workers: int, waiting: int):
        self.workers, self.waiting = workers, waiting
        self.context = context_tokens(spec)
        longest = longest_token(getattr(spec, "tokenizer", None)) if self.context else None
        self.max_chars = self.context * longest if self.context and longest else None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mlxspec-prompt")
        self._pending = 0  # running or waiting; touched on the event loop only

    def check_size(self, *parts: Any) -> None:
        """400 when PARTS (the prompt's texts, messages or tools) hold more characters than any
        prompt within the model's context can."""
        if self.max_chars is None:
            return
        n = text_size(parts)
        if n > self.max_chars:
            raise APIError(400, f"the prompt's text ({n} characters) is longer than this model's context of "
                                f"{self.context} tokens can hold; shorten it")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """FN(*ARGS) on the pool; 503 when the pool and its line are full."""
        if self._pending >= self.workers + self.waiting:
            raise APIError(503, f"the server is busy ({self._pending} prompts being prepared); retry shortly",
                           kind="overloaded_error", headers={"Retry-After": "1"})
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))
        finally:
            self._pending -= 1
