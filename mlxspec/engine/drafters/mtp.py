"""The model's own multi-token-prediction head drafts a chain of tokens.

The head reads pairs (h_t, x_{t+1}): the trunk's final-norm hidden state at position t and the
token that followed, and predicts x_{t+2}. Its KV cache holds one entry per committed pair;
the chain it drafts past them (feeding its own output hidden back) is trimmed after verify.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ...models.mtp.head import MTPHead
from ..cache import merged_caches, model_nbytes, restore_caches, snapshot_caches
from ..compiled_head import CompiledHead, head_forward
from ..sampling import SamplingParams
from .base import Draft, Drafter, chain_draft, joined_rows, sample_chain

ONE_PIECE = 16  # the widest verify: 16 drafts at most


class MTPDrafter(Drafter):
    name = "mtp"
    uses_model = True
    needs_hidden = True
    probes_in_flight = True
    drafts_together = True

    def __init__(self, head: MTPHead, target_nbytes: int | None = None, cost_per_token: float | None = None):
        self.head = head
        # Without a measured cost (`mlxspec tune`): one draft step runs the head's block and an
        # lm_head: the trunk's, unless the head ships its own (NextN shared_head.head, already
        # counted in head.nbytes).
        shared = getattr(getattr(head.module, "shared_head", None), "head", None) is None
        lm_bytes = model_nbytes(getattr(head.trunk.head, "__self__", head.trunk.head)) if shared else 0
        if cost_per_token is not None:
            self.cost_per_token = cost_per_token
        elif target_nbytes:
            self.cost_per_token = 0.05 + (head.nbytes + lm_bytes) / target_nbytes
        else:
            self.cost_per_token = 0.1
        self.cache = head.make_cache()
        self.pairs = 0
        self.gap = 0
        self._rows: list[mx.array] = []

    def start(self, prompt: list[int], resume=None, at: int = 0) -> None:
        self.cache = self.head.make_cache()
        CompiledHead.prepare(self.cache)
        self.pairs = 0  # committed pairs in the head's cache: (h_t, x_{t+1}) for t < pairs
        self._rows = []  # trunk rows h_t for t = pairs, pairs+1, ... not committed yet
        self.gap = 0  # pairs counted in `pairs` but absent from the head's cache
        if at and resume is None:
            # a cached prefix without this head's state: its pairs are left out of the head's
            # cache (drafts see less history; what is kept is still exactly the target's)
            self.pairs = self.gap = at
        elif resume is not None:
            snap, pairs, rows = resume
            # resume_point() made at >= pairs + 1, or at == pairs' trimmed count with no rows
            keep = min(pairs, at)
            restore_caches(self.cache, snap, keep)
            self.pairs = keep
            if at > keep:
                self._rows = [rows[: at - keep]]

    def resume_point(self, resume, at: int) -> int:
        # pair t uses token t+1: the cached pairs are valid for this prompt only below at - 1;
        # when the head ran further, restart one token earlier so the trunk re-makes h_{at-1}
        if resume is None or resume[1] < at:
            return at
        return at - 1

    def prefill(self, prompt: list[int], upto: int, hidden: mx.array | None = None) -> None:
        if hidden is not None and hidden.shape[0]:
            self._rows.append(hidden)
        # commit every prompt pair but the last (propose needs that one's logits), in chunks:
        # the head's attention then never sees more new pairs at once than the trunk's prefill
        self._commit(prompt, upto - 1, chunk=2048)

    def snapshot(self):
        if self.gap or (self.pairs == 0 and not self._rows):
            return None
        snap = snapshot_caches(self.cache, self.pairs)
        if snap is None:
            return None
        rows = self._pending()
        if rows is not None:
            mx.eval(rows)
        return snap, self.pairs, rows

    def add_hidden(self, rows: mx.array) -> None:
        self._rows.append(rows)

    def _pending(self) -> mx.array | None:
        return joined_rows(self._rows)

    def _forward(self, tokens: mx.array, rows: mx.array, step: int = 0) -> tuple[mx.array, mx.array]:
        """The head over pairs (rows (n, H), tokens (n,)) at draft step STEP: (its hidden (n, H),
        the logits (1, V) of the last row), as one compiled graph where it applies
        (``compiled_head.py``), else op by op."""
        return head_forward(self.head, tokens, rows, self.cache, step)

    def _commit(self, tokens: list[int], upto: int, chunk: int | None = None) -> tuple[mx.array, mx.array] | None:
        """Feed the head pairs t = pairs .. upto-1; returns its hidden for the last forward's
        pairs and the logits (1, V) of the last pair (None: nothing fed, or rows missing).

        Up to ONE_PIECE pairs go in one forward (a verify's accepted tokens); more go in
        power-of-two pieces of at most ``chunk``, then the rest: MLX's CUDA backend builds
        kernels for each new input shape, seconds a shape for an MoE head (a 23-row forward:
        64 s the first time, 2.8 ms after), and the pairs pending after a stretch of plain
        decoding or a prompt come in any number. So only a few shapes ever occur."""
        rows = self._pending()
        if upto > self.pairs and (rows is None or rows.shape[0] < upto - self.pairs):
            return None
        out = None
        while self.pairs < upto:
            rows = self._pending()
            n = upto - self.pairs
            if n > ONE_PIECE:
                n = 1 << (min(n, chunk or n).bit_length() - 1)
            new_tokens = mx.array(tokens[self.pairs + 1 : self.pairs + 1 + n], mx.uint32)
            if chunk is None:
                out = self._forward(new_tokens, rows[:n])
            else:  # a prompt's pairs, whose logits no one reads
                out = (self.head.forward(new_tokens, rows[:n], self.cache), None)
            self.pairs += n
            self._rows = [rows[n:]] if rows.shape[0] > n else []
            if chunk is not None:
                mx.eval([c.state for c in self.cache])
        return out

    def _can_propose(self, tokens: list[int], k: int) -> bool:
        last = len(tokens) - 1  # tokens[last] is sampled, not yet fed to the trunk
        if k <= 0 or last <= self.pairs:
            return False
        rows = self._pending()
        return rows is not None and rows.shape[0] >= last - self.pairs

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> Draft | None:
        if not self._can_propose(tokens, k):
            return None
        # Commit the new pairs t = pairs .. last-1 (one forward), then chain k drafts.
        hid, logits = self._commit(tokens, len(tokens) - 1)
        last_hidden = [hid[-1:]]  # the head's own output feeds the next chain step

        def step(i, tok):
            out, logits = self._forward(tok, last_hidden[0], step=i)
            last_hidden[0] = out
            return logits

        return sample_chain(logits, k, sampling, step)

    def rollback(self, committed: int) -> None:
        # Only the chain is speculative: keep the committed pairs.
        for c in self.cache:
            c.trim(c.offset - (self.pairs - self.gap))

    @classmethod
    def propose_together(cls, drafters, tokens, ks, samplings):
        """The rows' chains drafted as one: the rows' new pairs committed in one forward
        (:func:`commit_rows`), then one head forward a draft position serves every row, over
        the rows' caches merged left-padded (``BatchKVCache``: each row its own RoPE offset,
        its padding masked). Row i draws from its own rows, in the order :meth:`propose` draws,
        and stops at its own depth (rows past theirs are fed their last token, read by no
        one). The merged cache holds only the chains past the committed pairs and is dropped,
        as :meth:`rollback` drops them from a row's own cache. Fewer than two rows drafting, or
        caches that are not plain KV caches: each row's :meth:`propose`."""
        live = [i for i, (d, t, k) in enumerate(zip(drafters, tokens, ks, strict=True)) if d._can_propose(t, k)]
        head = drafters[live[0]].head if live else None
        if len(live) < 2 or any(drafters[i].head is not head or any(type(c) is not KVCache for c in drafters[i].cache)
                                for i in live):
            return super().propose_together(drafters, tokens, ks, samplings)
        ready = [drafters[i] for i in live]
        hidden, merged = commit_rows(ready, [tokens[i] for i in live])  # (B, H), the merged caches or None
        logits = head.logits(hidden)  # (B, V)
        chains = [([], []) for _ in live]  # each row's drawn tokens (1,) and their rows (1, V)
        depth = max(ks[i] for i in live)
        for pos in range(depth):
            fed = []
            for j, i in enumerate(live):
                drafted, qs = chains[j]
                if pos < ks[i]:
                    tok, lp = samplings[i].sample_with_logprobs(logits[j : j + 1])
                    drafted.append(tok)
                    qs.append(lp)
                fed.append(drafted[-1])
            if pos + 1 == depth:
                break
            if merged is None:
                merged = merged_caches([d.cache for d in ready])
            logits, hidden = head.step_rows(mx.concatenate(fed).astype(mx.uint32), hidden, merged, step=pos + 1)
        drafts: list[Draft | None] = [None] * len(drafters)
        for (drafted, qs), i in zip(chains, live):
            drafts[i] = chain_draft(drafted, qs, samplings[i])
        return drafts


def commit_rows(drafters: list[MTPDrafter], tokens: list[list[int]]) -> tuple[mx.array, list[BatchKVCache] | None]:
    """Commit each row's new pairs t = pairs .. len(tokens) - 2 (n_i of them, n_i >= 1) in one
    head forward of width W = max n_i over the rows' caches merged: row i feeds its n_i pairs
    then W - n_i pads. Its n_i new entries go to its own cache (a copy of theirs); in the
    merged one its pads are rolled back out (``roll_rows``, as the target's batch rolls back
    a verify's junk), so the chain drafts on it next. Returns (each row's head hidden of its
    last pair (B, H), the merged caches). Rows with more than ONE_PIECE pairs pending (after
    a prompt or plain decoding): each commits alone, in its pieces; no merged cache (None)."""
    counts = [len(t) - 1 - d.pairs for d, t in zip(drafters, tokens, strict=True)]
    assert min(counts) >= 1, counts
    if max(counts) > ONE_PIECE:
        return mx.concatenate([d._commit(t, len(t) - 1)[0][-1:] for d, t in zip(drafters, tokens)]), None
    width = max(counts)
    pending = [d._pending() for d in drafters]
    inputs = mx.array([t[d.pairs + 1 : d.pairs + 1 + n] + [t[-1]] * (width - n)
                       for d, t, n in zip(drafters, tokens, counts)], mx.uint32)  # (B, W)
    hidden = mx.stack([mx.pad(p[:n], [(0, width - n), (0, 0)]) for p, n in zip(pending, counts)])  # (B, W, H)
    merged = merged_caches([d.cache for d in drafters])
    layer = merged[0]  # a commit runs the head's first layer (step 0), as _commit does
    start = layer.size()  # the merged rows' write index
    out = drafters[0].head.forward_rows(inputs, hidden, merged)  # (B, W, H)
    for j, (d, n) in enumerate(zip(drafters, counts)):
        d.cache[0].update_and_fetch(layer.keys[j : j + 1, :, start : start + n],
                                    layer.values[j : j + 1, :, start : start + n])
        d.pairs += n
        d._rows = [pending[j][n:]] if pending[j].shape[0] > n else []
    junk = [width - n for n in counts]
    if min(junk):
        layer.trim(min(junk))
    if max(junk) > min(junk):
        roll_rows([layer], [j - min(junk) for j in junk])
    return out[mx.arange(len(drafters)), mx.array(counts) - 1], merged


def roll_rows(layers: list[BatchKVCache], shifts: list[int]) -> None:
    """Roll row i of every layer right by SHIFTS[i] along the sequence, its padding growing as
    much: what ``BatchKVCache.prepare(right_padding=...)`` and ``finalize`` do, with the gather
    index, offsets and paddings built once for all layers (every layer holds the same rows at
    the same places), so a step pays one gather per keys and values array and nothing else.
    The layers then share their offset and padding arrays: mlx-lm replaces them, never
    updates them in place, outside ``prepare`` (empty caches) and ``finalize`` (not used).
    (The head's merged cache is one small layer; the target's batch moves no rows:
    engine/ragged_kv.py.)"""
    by = mx.array(shifts)
    offset, padding = layers[0].offset - by, layers[0].left_padding + by
    index: dict[int, mx.array] = {}
    for layer in layers:
        n = layer.keys.shape[2]
        if n not in index:  # (B, 1, n, 1): row b's slot t takes slot (t - shift_b) mod n
            index[n] = ((mx.arange(n)[None] - by[:, None]) % n)[:, None, :, None]
        layer.keys = mx.take_along_axis(layer.keys, index[n], axis=2)
        layer.values = mx.take_along_axis(layer.values, index[n], axis=2)
        layer.offset, layer.left_padding = offset, padding
