"""Gemma 4's assistant drafts a block from the target's own cache.

Each step reads the target's K/V where they lie (its last eligible full-attention and
sliding-attention layers' cache entries, sliced, never copied), so after a partial accept it
sees exactly what the rolled-back target cache holds. The first ``h_prev`` is the target's
final-norm hidden state at the last fed position (the engine hands the drafter those rows, as
to MTP heads); the queries of the whole block sit at the position of the last committed token.

Sliding layers give their last ``sliding_window`` keys: what mlx-lm's ring keeps after a 1-token
step (transformers' inclusive bidirectional window would take one more, which the ring no longer
holds; reading a fixed W keeps drafts independent of how the cache was filled).
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ...compat import ring_index
from ...errors import DrafterError
from ...models.gemma4_assistant import Gemma4Assistant, check_pair, shared_layers
from ...models.trunk import split_trunk
from ..cache import ModelState, model_nbytes
from ..sampling import SamplingParams
from .base import Draft, Drafter, sample_chain


def recent_kv(cache, window: int | None) -> tuple[mx.array, mx.array]:
    """The keys and values a cache entry holds, the last WINDOW of them (None: all), as views.

    A ring that wrapped under 1-token writes holds exactly its last ``max_size`` tokens in
    rotated order: attention over them without a mask does not depend on the order, so it is
    read as it lies unless a shorter window must pick the newest."""
    if isinstance(cache, RotatingKVCache):
        keys, values = cache.keys, cache.values
        idx, size = ring_index(cache), keys.shape[2]
        if idx < size and cache.offset > idx:  # wrapped in place: rotated order
            if window is None or window >= size:
                return keys, values
            order = mx.concatenate([mx.arange(idx, size), mx.arange(0, idx)])[-window:]
            return keys[..., order, :], values[..., order, :]
        n = idx  # temporal order; the first idx slots are valid
    elif isinstance(cache, KVCache):
        keys, values, n = cache.keys, cache.values, cache.offset
    else:
        raise DrafterError(f"the Gemma-4 assistant cannot read a {type(cache).__name__}")
    start = 0 if window is None else max(0, n - window)
    return keys[..., start:n, :], values[..., start:n, :]


class AssistantDrafter(Drafter):
    name = "assistant"
    uses_model = True
    needs_hidden = True

    def __init__(self, assistant: Gemma4Assistant, target, target_nbytes: int | None = None,
                 cost_per_token: float | None = None):
        check_pair(target, assistant)
        self.assistant = assistant
        self.layers = shared_layers(target)  # layer type -> target cache entry
        trunk = split_trunk(target)
        self.embed = trunk.embed
        self.embed_scale = math.sqrt(assistant.backbone_hidden_size)
        # Without a measured cost: a step streams the assistant's weights (its LM head included;
        # the sparse head reads only a few clusters' rows, but the centroids and layers dominate
        # less than the table does, so the bytes ratio overestimates it a little).
        if cost_per_token is not None:
            self.cost_per_token = cost_per_token
        elif target_nbytes:
            self.cost_per_token = 0.05 + model_nbytes(assistant) / target_nbytes
        else:
            self.cost_per_token = 0.1
        self.target: ModelState | None = None
        self.fed = 0  # target positions whose hidden rows were handed over
        self.last_row: mx.array | None = None  # the hidden row of position fed - 1

    def bind_target(self, state: ModelState) -> None:
        self.target = state

    def start(self, prompt: list[int], resume=None, at: int = 0) -> None:
        self.fed, self.last_row = at, None
        if resume is not None and resume[0] == at:
            self.last_row = resume[1]

    def prefill(self, prompt: list[int], upto: int, hidden: mx.array | None = None) -> None:
        if hidden is not None and hidden.shape[0]:
            self.add_hidden(hidden)

    def add_hidden(self, rows: mx.array) -> None:
        self.fed += rows.shape[0]
        self.last_row = rows[-1:]

    def snapshot(self):
        if self.last_row is None:
            return None
        mx.eval(self.last_row)
        return self.fed, self.last_row

    def shared_kv(self) -> dict:
        """Layer type -> (keys, values) of the target cache as it is now."""
        cache = self.target.cache
        window = self.assistant.sliding_window
        return {
            kind: recent_kv(cache[i], window if kind == "sliding_attention" else None)
            for kind, i in self.layers.items()
        }

    def stepper(self, position: int):
        """``step(i, token) -> logits (1, V)``: one assistant step from TOKEN (1,), chained on
        the hidden state of the step before; the queries of every step sit at POSITION."""
        shared = self.shared_kv()
        h_prev = [self.last_row]

        def step(i, tok):
            x = mx.concatenate([self.embed(tok.reshape(1)) * self.embed_scale, h_prev[0]], axis=-1)
            logits, h_prev[0] = self.assistant(x, shared, position)
            return logits

        return step

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> Draft | None:
        position = len(tokens) - 1  # tokens[-1] is sampled, not fed: the target holds `position`
        if k <= 0 or self.target is None or self.last_row is None or position == 0:
            return None
        if self.fed != position or self.target.length != position:
            return None  # a row is missing (a cached prefix without ours): plain steps refill it
        step = self.stepper(position)
        first = step(0, mx.array(tokens[-1:], mx.uint32))
        return sample_chain(first, k, sampling, step)
