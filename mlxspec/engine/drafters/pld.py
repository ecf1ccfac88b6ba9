"""Prompt lookup: propose what followed the most recent earlier occurrence of the current suffix.

An index maps every n-gram (n = min..max) to the position where it last ended, so a lookup
costs O(max_ngram) dictionary probes, not a scan of the history. It is updated incrementally
as tokens are committed; committed tokens never change, so it never needs rolling back.
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import SamplingParams
from ..tree import tree_from_paths
from .base import Draft, Drafter


class PromptLookupDrafter(Drafter):
    name = "pld"
    cost_per_token = 0.0

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, cost_per_token: float | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if cost_per_token is not None:  # measured (`mlxspec tune`); lookups are otherwise free
            self.cost_per_token = cost_per_token
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._index: dict[tuple[int, ...], int] = {}
        # the earlier ends of each n-gram, newest last (a few): further candidates for trees
        self._earlier: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending at positions < _indexed are in the index

    def start(self, prompt: list[int], resume=None, at: int = 0) -> None:
        self._index.clear()
        self._earlier.clear()
        self._indexed = 0

    def _catch_up(self, tokens: list[int]) -> None:
        # Index every end position except the last: the suffix must match an *earlier* place.
        end = len(tokens) - 1
        for i in range(self._indexed, end):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if i + 1 >= n:
                    gram = tuple(tokens[i + 1 - n : i + 1])
                    old = self._index.get(gram)
                    if old is not None:
                        ends = self._earlier.setdefault(gram, [])
                        ends.append(old)
                        del ends[: -self.PATHS]
                    self._index[gram] = i
        self._indexed = max(self._indexed, end)

    def prefill(self, prompt: list[int], upto: int, hidden: mx.array | None = None) -> None:
        # The prompt is indexed chunk by chunk as the target takes it in, not all in the first
        # decoding step: at 32K tokens that step waited about 40 ms for it (this project's x86
        # development CPU), inside the decode time.
        self._catch_up(prompt[:upto])

    PATHS = 4  # candidate continuations a tree merges at most

    def paths(self, tokens: list[int], k: int) -> list[list[int]]:
        """Up to PATHS different continuations: after the latest match of the longest suffix
        first (what :meth:`lookup` proposes), then earlier matches, then shorter suffixes'."""
        if k <= 0 or len(tokens) < self.min_ngram + 1:
            return []
        self._catch_up(tokens)
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            gram = tuple(tokens[-n:])
            ends = ([self._index[gram]] if gram in self._index else []) + self._earlier.get(gram, [])[::-1]
            for pos in ends:
                path = self._copy(tokens, pos, k)
                if path and path not in found:
                    found.append(path)
                if len(found) == self.PATHS:
                    return found
        return found

    def propose_tree(self, tokens: list[int], k: int, budget: int, sampling: SamplingParams):
        found = self.paths(tokens, k)
        return tree_from_paths(found, budget) if len(found) > 1 else None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self.peek(tokens, [], k)

    def _search(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pos = self._index.get(tuple(tokens[-n:]))
            if pos is not None:
                return self._copy(tokens, pos, k)
        return []

    @staticmethod
    def _copy(tokens: list[int], pos: int, k: int) -> list[int]:
        # Copy forward from the match; a match close to the end copies its own output, so a
        # periodic run (x y x y ...) yields a full-length draft.
        found = tokens[pos + 1 : pos + 1 + k]
        while len(found) < k:
            found.append(found[len(found) - (len(tokens) - pos - 1)])
        return found

    def peek(self, tokens: list[int], extra: list[int], k: int) -> list[int]:
        # Only the committed tokens are indexed: n-grams ending inside ``extra`` are not
        # (lookup after the commit may find a later match; the caller compares the two).
        if k <= 0 or len(tokens) + len(extra) < self.min_ngram + 1:
            return []
        self._catch_up(tokens)
        return self._search(tokens + extra if extra else tokens, k)

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> Draft | None:
        found = self.lookup(tokens, k)
        if not found:
            return None
        return Draft(mx.array(found, mx.uint32), None, found)


def repetition_score(tokens: list[int], n: int = 3, window: int = 4096) -> float:
    """Share of positions whose n-gram already occurred earlier: how much prompt lookup can find."""
    tail = tokens[-window:]
    if len(tail) <= n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(n, len(tail) + 1):
        gram = tuple(tail[i - n : i])
        repeats += gram in seen
        seen.add(gram)
    return repeats / (len(tail) - n + 1)
