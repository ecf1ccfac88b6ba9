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


def random_schedule(batch, queue: list, start, rng, join_p: float, leaves) -> tuple[list, int, int]:
    """Requests popped from QUEUE join BATCH at random steps (one whenever none runs, else with
    probability JOIN_P while it has room), each stream START(i); a client leaves when
    LEAVES(finished so far, cancelled so far) is true. Returns (finished: (i, tokens),
    cancelled count, the most rows decoded together); every row has left the batch."""
    live, finished, cancelled, most = [], [], 0, 0
    while queue or live:
        if queue and not batch.full and (not live or rng.random() < join_p):
            i = queue.pop()
            live.append((i, start(i), []))
        for entry in list(live):
            i, stream, got = entry
            if got and leaves(finished, cancelled):
                stream.close()
                live.remove(entry)
                cancelled += 1
                continue
            try:
                got.extend(next(stream).tokens)
            except StopIteration:
                live.remove(entry)
                finished.append((i, got))
        most = max(most, len(batch.rows))
    assert len(batch) == 0 and batch.cache.layers is None  # every row left
    return finished, cancelled, most
