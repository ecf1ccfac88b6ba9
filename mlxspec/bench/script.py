"""Scripted outputs for ``mlxspec bench --real-shapes``: random-weight models whose every token
is known in advance.

A random model's logits say nothing, so its greedy output says nothing about speculation. Here
the target's logits are replaced, after its real forward, by a one-hot on a scripted
continuation: the forward's cost is still paid (the replacement depends on its logits), and the
output must equal the script exactly. Drafters are steered the same way: their real work is
done and then their proposals follow a second script that agrees with the target's at each
position with probability ``a`` (decided per position, so every engine meets the same drafts).

Workloads (token ids, no tokenizer):
- ``echo``: the continuation re-emits spans of the prompt, with an edit every ~25 tokens;
- ``novel``: tokens absent from the prompt;
- ``scripted-aA``: novel tokens, with the drafters' proposals right with probability A.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..compat import swap_class
from ..engine.drafters.assistant import AssistantDrafter
from ..engine.drafters.base import Draft
from ..engine.drafters.mtp import MTPDrafter
from ..engine.drafters.pld import PromptLookupDrafter
from ..errors import UsageError

HOT = 30.0  # the scripted token's logit over 0 elsewhere: one-hot even at temperature 0.7
EDIT_EVERY = 25


@dataclass
class Script:
    """``target[p]``: the token at position p (prompt, then continuation); ``drafted[p]``: what
    a steered drafter proposes for position p."""

    name: str
    prompt: list[int]
    target: list[int]
    drafted: list[int]
    acceptance: float | None  # the steering's a; None: drafters are not steered

    @property
    def continuation(self) -> list[int]:
        return self.target[len(self.prompt):]

    def drafts(self, start: int, k: int) -> list[int]:
        """A steered proposal for positions start .. start+k-1."""
        tail = self.drafted[-1]
        return [self.drafted[p] if p < len(self.drafted) else tail for p in range(start, start + k)]


def parse_workload(name: str) -> float | None:
    """The steering acceptance of a workload name (None for echo / novel)."""
    if name in ("echo", "novel"):
        return None
    if name.startswith("scripted-a"):
        try:
            a = float(name[len("scripted-a"):])
        except ValueError:
            a = -1.0
        if 0.0 <= a <= 1.0:
            return a
    raise UsageError(f"unknown workload '{name}': echo, novel or scripted-aA with 0 <= A <= 1 "
                     "(e.g. scripted-a0.8)")


def make_script(name: str, vocab: int, prompt_tokens: int, max_tokens: int, seed: int = 0,
                margin: int = 32) -> Script:
    """The workload ``name`` over ids below ``vocab``: a prompt of ``prompt_tokens`` random ids
    from the lower half of the vocabulary, then ``max_tokens`` + ``margin`` scripted ones (the
    margin covers drafts past the end)."""
    a = parse_workload(name)
    rng = random.Random(f"{name}/{seed}")
    half = max(vocab // 2, 2)
    prompt = [rng.randrange(1, half) for _ in range(prompt_tokens)]
    n = max_tokens + margin
    if name == "echo":
        out: list[int] = []
        src = rng.randrange(prompt_tokens)
        next_edit = rng.randint(EDIT_EVERY // 2, EDIT_EVERY * 3 // 2)
        while len(out) < n:
            if next_edit == 0:
                out.append(rng.randrange(half, vocab))  # an edit: a token the prompt lacks
                next_edit = rng.randint(EDIT_EVERY // 2, EDIT_EVERY * 3 // 2)
                if rng.random() < 0.3:  # now and then the echo jumps elsewhere
                    src = rng.randrange(prompt_tokens)
            else:
                out.append(prompt[src % prompt_tokens])
                next_edit -= 1
            src += 1
    else:  # novel and scripted: ids from the upper half, never in the prompt
        out = [rng.randrange(half, vocab) for _ in range(n)]
    target = prompt + out
    drafted = list(target)
    if a is not None:
        steer = random.Random(f"steer/{name}/{seed}")
        for p in range(len(prompt), len(target)):
            if steer.random() >= a:  # a wrong token, never the target's
                drafted[p] = (target[p] + 1 + steer.randrange(vocab - 1)) % vocab
    return Script(name, prompt, target, drafted, a)


def _cache_offset(cache) -> int:
    for c in cache or ():
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0


class ScriptedLogits:
    """Replaces ``model``'s logits by a one-hot on ``table[p + 1]`` for the row at position p.

    The body (tokens -> hidden) notes the positions of its rows from the cache; the lm_head
    call for those rows replaces its output. Other head calls (an MTP head's logits through the
    shared lm_head) keep the real logits."""

    def __init__(self, model: nn.Module, table: list[int]):
        self.table = mx.array(table, mx.int32)
        self.pending: tuple[int, int] | None = None
        lm = getattr(model, "language_model", model)
        body = lm.model
        base = type(body)
        outer = self

        def call(self_, inputs, cache=None, *args, **kwargs):
            outer.pending = (_cache_offset(cache), inputs.shape[1])
            return base.__call__(self_, inputs, cache, *args, **kwargs)

        # a subclass for this one instance: the model's own __call__ reaches it unchanged
        swap_class(body, type(f"Scripted{base.__name__}", (base,), {"__call__": call}))
        if hasattr(lm, "lm_head") and not getattr(lm.args, "tie_word_embeddings", False):
            lm.lm_head = _Head(lm.lm_head, self)
        else:
            head = _Head(body.embed_tokens, self, tied=True)
            body.embed_tokens.as_linear = head.__call__

    def replace(self, logits: mx.array) -> mx.array:
        # the trunk's rows come as (1, n, V); an MTP head's through the same lm_head as (n, V)
        if self.pending is None or logits.ndim != 3 or logits.shape[1] != self.pending[1]:
            return logits
        (offset, n), self.pending = self.pending, None
        where = mx.minimum(mx.arange(offset + 1, offset + 1 + n), self.table.shape[0] - 1)
        hot = mx.arange(logits.shape[-1])[None] == self.table[where][:, None]
        # the real logits stay a data dependency: their whole lm_head matmul is still computed
        return mx.where(hot, HOT, 0.0).astype(logits.dtype) + logits[..., :1] * 0


class _Head(nn.Module):
    def __init__(self, inner: nn.Module, script: ScriptedLogits, tied: bool = False):
        super().__init__()
        self.inner = inner
        self._script = script
        self._call = type(inner).as_linear.__get__(inner) if tied else inner

    def __call__(self, x: mx.array) -> mx.array:
        return self._script.replace(self._call(x))


class SteeredLookup(PromptLookupDrafter):
    """Prompt lookup whose proposals (and guesses) are the steered script's, at no cost."""

    def __init__(self, script: Script):
        super().__init__()
        self.script = script

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self.script.drafts(len(tokens), k) if k > 0 else []

    def peek(self, tokens: list[int], extra: list[int], k: int) -> list[int]:
        return self.script.drafts(len(tokens) + len(extra), k) if k > 0 else []


class SteeredMTP(MTPDrafter):
    """The MTP head drafts for real (its cost is paid), then its tokens become the script's."""

    def __init__(self, head, target_nbytes: int, script: Script, cost_per_token: float | None = None):
        super().__init__(head, target_nbytes, cost_per_token)
        self.script = script

    def propose(self, tokens, k, sampling):
        return steer(super().propose(tokens, k, sampling), self.script, len(tokens))


class SteeredAssistant(AssistantDrafter):
    """The Gemma-4 assistant drafts for real from the target's cache (its cost is paid), then its
    tokens become the script's."""

    def __init__(self, assistant, target, script: Script, target_nbytes: int | None = None,
                 cost_per_token: float | None = None):
        super().__init__(assistant, target, target_nbytes, cost_per_token)
        self.script = script

    def propose(self, tokens, k, sampling):
        return steer(super().propose(tokens, k, sampling), self.script, len(tokens))


def steer(draft: Draft | None, script: Script, start: int) -> Draft | None:
    """DRAFT's tokens replaced by the script's proposal from position START; the real tokens stay
    a data dependency, so the drafting is still computed."""
    if draft is None:
        return None
    want = mx.array(script.drafts(start, len(draft)), mx.uint32)
    return Draft(draft.tokens * 0 + want, draft.logprobs)
