"""Reading several generation streams at once, as a server's clients do (tests of batches)."""

from __future__ import annotations


def drain_items(streams) -> list[list]:
    """Every stream's items, one item from each in turn until all end."""
    streams = list(streams)
    got: list[list] = [[] for _ in streams]
    while any(s is not None for s in streams):
        for j, stream in enumerate(streams):
            item = next(stream, None) if stream is not None else None
            if item is None:
                streams[j] = None
            else:
                got[j].append(item)
    return got


def drain(streams, tokens=lambda chunk: chunk.tokens) -> list[list[int]]:
    """Every stream's tokens (TOKENS of each item), the streams read in turn (:func:`drain_items`)."""
    return [[t for item in items for t in tokens(item)] for items in drain_items(streams)]
