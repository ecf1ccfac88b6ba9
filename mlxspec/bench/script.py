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
- profiles (:data:`PROFILES`): novel tokens; the proposal for block position i (1-based, from
  the step's first drafted position) is decided per (step start, i): the drafter's top-1 is the
  script's token with probability r_i, else (probability s) its top-2 is, else neither (the
  script's token is pushed far down). ``dflash``: r_i = 0.97 x 0.95^(i-1), s = 0.5 (so draft
  trees have siblings to win); ``mtp-like``: r = 0.73 / 0.66 / 0.67 by position, 0.67 on.
  Steered chain drafters propose the top-1; a steered DFlash drafter's block rows put the top-1
  and top-2 there with probabilities r_i and s(1 - r_i), the rest spread evenly.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.drafters.assistant import AssistantDrafter
from ..engine.drafters.base import Draft
from ..engine.drafters.dflash import DFlashDrafter
from ..engine.drafters.mtp import MTPDrafter
from ..engine.drafters.pld import PromptLookupDrafter
from ..engine.tree import tree_from_marginals
from ..errors import UsageError
from ..models.tree_attention import current as current_tree
from . import scripted

EDIT_EVERY = 25
PROFILE_DEPTH = 32  # block positions a profile decides per step; deeper ones are never right
DEMOTED = -30.0  # the script's token in a block row where neither top-1 nor top-2 is it


@dataclass(frozen=True)
class Profile:
    """Per-position steering: ``right[i - 1]`` = r_i (the last value holds on), ``sibling`` = s."""

    name: str
    right: tuple[float, ...]
    sibling: float

    def r(self, i: int) -> float:
        return self.right[min(i, len(self.right)) - 1]


PROFILES = {
    "dflash": Profile("dflash", tuple(0.97 * 0.95 ** (i - 1) for i in range(1, PROFILE_DEPTH + 1)), 0.5),
    "mtp-like": Profile("mtp-like", (0.73, 0.66, 0.67), 0.0),
}


@dataclass
class Script:
    """``target[p]``: the token at position p (prompt, then continuation); ``drafted[p]``: what
    a steered drafter proposes for position p."""

    name: str
    prompt: list[int]
    target: list[int]
    drafted: list[int]
    acceptance: float | None  # the steering's a; None: drafters are not steered
    profile: Profile | None = None
    # profiles: per step start (from len(prompt)) and block position, a uniform and two offsets
    # that make the wrong tokens
    events: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    vocab: int = 0

    @property
    def continuation(self) -> list[int]:
        return self.target[len(self.prompt):]

    @property
    def steered(self) -> bool:
        return self.acceptance is not None or self.profile is not None

    def drafts(self, start: int, k: int) -> list[int]:
        """A steered proposal for positions start .. start+k-1 (a profile's: the top-1s)."""
        if self.profile is not None:
            return [self.ranked(start, i)[0] for i in range(1, k + 1)]
        tail = self.drafted[-1]
        return [self.drafted[p] if p < len(self.drafted) else tail for p in range(start, start + k)]

    def ranked(self, start: int, i: int) -> tuple[int, int, bool]:
        """A profile's (top-1, top-2, whether the script's token is neither) for block position
        i of the step whose first drafted position is START."""
        u, x, y = self.events
        vocab = self.vocab
        p = start + i - 1
        t = self.target[p] if p < len(self.target) else self.target[-1]
        row = min(max(start - len(self.prompt), 0), u.shape[0] - 1)
        wrong_a = (t + 1 + int(x[row, i - 1])) % vocab if i <= PROFILE_DEPTH else (t + 1) % vocab
        wrong_b = (t + 1 + (int(x[row, i - 1]) + 1 + int(y[row, i - 1])) % (vocab - 1)) % vocab \
            if i <= PROFILE_DEPTH else (t + 2) % vocab
        r, s = self.profile.r(i), self.profile.sibling
        draw = float(u[row, i - 1]) if i <= PROFILE_DEPTH and p < len(self.target) else 2.0
        if draw < r:
            return t, wrong_a, False
        if draw < r + s * (1 - r):
            return wrong_a, t, False
        return wrong_a, wrong_b, True


def parse_workload(name: str) -> float | None:
    """The steering acceptance of a workload name (None for echo / novel and the profiles)."""
    if name in ("echo", "novel") or name in PROFILES:
        return None
    if name.startswith("scripted-a"):
        try:
            a = float(name[len("scripted-a"):])
        except ValueError:
            a = -1.0
        if 0.0 <= a <= 1.0:
            return a
    raise UsageError(f"unknown workload '{name}': echo, novel, {', '.join(PROFILES)} or scripted-aA "
                     "with 0 <= A <= 1 (e.g. scripted-a0.8)")


def make_script(name: str, vocab: int, prompt_tokens: int, max_tokens: int, seed: int = 0,
                margin: int = 32) -> Script:
    """The workload ``name`` over ids below ``vocab``: a prompt of ``prompt_tokens`` random ids
    from the lower half of the vocabulary, then ``max_tokens`` + ``margin`` scripted ones (the
    margin covers drafts past the end)."""
    parse_workload(name)
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
    return steered_script(name, prompt, prompt + out, vocab, seed)


def steered_script(name: str, prompt: list[int], target: list[int], vocab: int, seed: int) -> Script:
    """The Script of workload NAME over TARGET (prompt + continuation): its drafters' steering
    (a profile's events, or scripted-aA's wrong tokens), decided from NAME and SEED."""
    a = parse_workload(name)
    drafted = list(target)
    if name in PROFILES:
        gen = np.random.default_rng(list(f"profile/{name}/{seed}".encode()))
        shape = (len(target) - len(prompt) + 2, PROFILE_DEPTH)
        events = (gen.random(shape), gen.integers(0, vocab - 1, shape), gen.integers(0, max(vocab - 2, 1), shape))
        return Script(name, prompt, target, drafted, None, PROFILES[name], events, vocab)
    if a is not None:
        steer = random.Random(f"steer/{name}/{seed}")
        for p in range(len(prompt), len(target)):
            if steer.random() >= a:  # a wrong token, never the target's
                drafted[p] = (target[p] + 1 + steer.randrange(vocab - 1)) % vocab
    return Script(name, prompt, target, drafted, a, vocab=vocab)


def make_follow_scripts(name: str, vocab: int, requests: int, prompt_tokens: int, max_tokens: int,
                        seed: int = 0, margin: int = 32) -> tuple[np.ndarray, list[Script]]:
    """REQUESTS scripts of workload NAME that one successor table drives (``ScriptedLogits.follow``):
    (table, scripts), where each script's continuation is the chain ``table[x]`` from its prompt's
    last token, so the rows of a batch follow their own scripts in any row order. Requests use
    disjoint tokens: prompts from the lower half of the vocabulary, novel tokens and edits from
    the upper half. ``echo``: the prompt's tokens follow each other, but at an edit point every
    ~EDIT_EVERY tokens a new token comes between (and now and then the text jumps elsewhere);
    the continuation echoes the prompt from a random point (prompt lookup drafts it and misses
    at the edits). The others: novel tokens, drafters steered as :func:`make_script` steers them."""
    parse_workload(name)
    rng = random.Random(f"follow/{name}/{seed}")
    half = max(vocab // 2, 2)
    n = max_tokens + margin
    if requests * prompt_tokens > half - 1 or requests * n > vocab - half:
        raise UsageError(f"{requests} scripted requests of {prompt_tokens} + {n} tokens do not fit a vocabulary "
                         f"of {vocab}")
    lower = rng.sample(range(1, half), requests * prompt_tokens)
    upper = iter(rng.sample(range(half, vocab), requests * n))
    table = (np.arange(vocab, dtype=np.int64) + 1) % vocab  # tokens outside every script: any successor
    scripts = []
    for r in range(requests):
        prompt = lower[r * prompt_tokens:(r + 1) * prompt_tokens]
        table[prompt[:-1]] = prompt[1:]
        if name == "echo":
            head = max(prompt_tokens - max_tokens - 16, 1)  # echoing from here never reaches the end
            i = rng.randint(EDIT_EVERY // 2, EDIT_EVERY * 3 // 2)
            while i < prompt_tokens - 1:
                edit = next(upper)
                resume = prompt[rng.randrange(head)] if rng.random() < 0.3 else prompt[i + 1]
                table[prompt[i]], table[edit] = edit, resume
                i += rng.randint(EDIT_EVERY // 2, EDIT_EVERY * 3 // 2)
            table[prompt[-1]] = prompt[rng.randrange(head)]
        else:
            chain = [next(upper) for _ in range(n)]
            table[prompt[-1]] = chain[0]
            table[chain[:-1]] = chain[1:]
            table[chain[-1]] = chain[0]
        out, x = [], prompt[-1]
        for _ in range(n):
            x = int(table[x])
            out.append(x)
        scripts.append(steered_script(name, prompt, prompt + out, vocab, seed * 1000 + r))
    return table, scripts


class ScriptedLogits(scripted.ScriptedLogits):
    """:class:`.scripted.ScriptedLogits` that sees the engine's tree verifies (a node's row at
    the cache offset plus its depth)."""

    def __init__(self, model: nn.Module, table: list[int]):
        super().__init__(model, table, current_tree)


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

    @classmethod
    def propose_together(cls, drafters, tokens, ks, samplings):
        # the rows' chains drafted together for real, then each row's the script's (a row that
        # drafted alone went through propose, already steered: steering again changes nothing)
        drafts = super().propose_together(drafters, tokens, ks, samplings)
        return [steer(d, r.script, len(t)) for d, r, t in zip(drafts, drafters, tokens, strict=True)]


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


class SteeredDFlash(DFlashDrafter):
    """The DFlash drafter runs its block forward and LM head for real (its cost is paid), then
    its rows become the profile's (:func:`steered_rows`), so its chains and trees follow the
    script. ``tree_log``: (nodes, depth) of every tree it proposed."""

    def __init__(self, model, target, script: Script, target_nbytes: int | None = None,
                 cost_per_step: float | None = None):
        super().__init__(model, target, target_nbytes, cost_per_step)
        self.script = script
        self.tree_log: list[tuple[int, int]] = []

    def block_rows(self, tokens, logits):
        if self.script.profile is None:
            return logits
        return steered_rows(self.script, len(tokens), logits)

    def propose_tree(self, tokens, k, budget, sampling):
        tree = super().propose_tree(tokens, k, budget, sampling)
        if tree is not None and len(tree):
            self.tree_log.append((len(tree), max(tree.depths())))
        return tree


def profile_values(profile: Profile, i: int, vocab: int) -> tuple[float, float]:
    """Logits of block position i's top-1 and top-2 over 0 for the rest, so that the row's
    probabilities are r_i, s(1 - r_i) and the remainder spread over the other tokens."""
    r, s = profile.r(i), profile.sibling
    each = max((1 - s) * (1 - r), 1e-6) / max(vocab - 2, 1)
    return math.log(r / each), (math.log(s * (1 - r) / each) if s > 0 else 0.0)


def steered_rows(script: Script, start: int, logits: mx.array) -> mx.array:
    """(k, V) float32 rows of block positions 1..k for the step drafting from START: the
    profile's top-1 / top-2 (the script's token demoted where neither is it); the real logits
    stay a data dependency, so the block forward and LM head are still computed."""
    k, vocab = logits.shape
    top1, top2, low, v1, v2, v3 = [], [], [], [], [], []
    for i in range(1, k + 1):
        a, b, neither = script.ranked(start, i)
        one, two = profile_values(script.profile, i, vocab)
        p = start + i - 1
        t = script.target[p] if p < len(script.target) else a
        top1.append(a), top2.append(b), v1.append(one), v2.append(two)
        low.append(t if neither else a), v3.append(DEMOTED if neither else 0.0)
    col = mx.arange(vocab)[None]
    put = lambda ids, vals: mx.where(col == mx.array(ids)[:, None], mx.array(vals)[:, None], 0.0)  # noqa: E731
    rows = put(top1, v1) + put(top2, v2) + put(low, v3)
    return rows.astype(mx.float32) + logits[:, :1].astype(mx.float32) * 0


def profile_rows(profile: Profile, k: int, vocab: int) -> mx.array:
    """(k, V) log-probabilities of a steered block with top-1 token 0 and top-2 token 1: every
    step's rows up to the token ids, so every step's tree has this one's shape."""
    rows = []
    for i in range(1, k + 1):
        one, two = profile_values(profile, i, vocab)
        rows.append(mx.concatenate([mx.array([one, two]), mx.zeros((vocab - 2,))]))
    rows = mx.stack(rows)
    return rows - mx.logsumexp(rows, axis=-1, keepdims=True)


def profile_tree(profile: Profile, k: int, budget: int, vocab: int):
    """The DDTree of BUDGET nodes over k block rows that a steered DFlash drafter proposes."""
    return tree_from_marginals(profile_rows(profile, k, vocab), budget)


@functools.lru_cache(maxsize=None)
def tree_depth(name: str, budget: int, block: int, vocab: int = 1 << 17) -> tuple[int, float]:
    """(k, expected drafted tokens kept): the depth 1 <= k < BUDGET (k < BLOCK) whose tree of
    BUDGET nodes keeps the most under profile NAME, and that expectation. A node is kept with
    the product over its path of r_d (a top-1) or s(1 - r_d) (a top-2)."""
    profile = PROFILES[name]
    best = (0, -1.0)
    for k in range(1, min(budget, block)):
        with mx.stream(mx.cpu):  # host arithmetic: no GPU kernels built for each of these shapes
            tree = profile_tree(profile, k, budget, vocab)
        kept, p = 0.0, [1.0]
        for node, (tok, parent) in enumerate(zip(tree.tokens, tree.parents), start=1):
            d = tree.depth(node)
            r = profile.r(d)
            p.append(p[parent] * (r if tok == 0 else profile.sibling * (1 - r) if tok == 1 else 0.0))
            kept += p[-1]
        if kept > best[1] + 1e-9:
            best = (k, kept)
    return best
