"""The drafter interface: every proposer (prompt lookup, draft model, MTP head) implements it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import mlx.core as mx

from ..sampling import SamplingParams
from ..tree import tree_from_chain_topk

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Draft:
    tokens: mx.array  # (k,) proposed tokens, on device
    logprobs: mx.array | None = None  # (k, V) processed q they were drawn from; None = one-hot
    host: list[int] | None = None  # the same tokens on the host, when drafted there
    rows: mx.array | None = None  # (k, V) processed rows each position was drawn from (trees rank them)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def host_tokens(self) -> list[int]:
        """The tokens on the host: ``host`` when drafted there, else read from the device."""
        return self.host if self.host is not None else self.tokens.tolist()


class Drafter(ABC):
    """Proposes up to ``k`` tokens to follow the committed sequence.

    ``tokens`` passed to the methods is the engine's committed sequence: prompt + output, whose
    last token has been sampled but not yet fed to the target. It only ever grows.
    """

    name: str = "?"
    # Relative cost of drafting one token, in units of one target forward (for the depth choice).
    cost_per_token: float = 0.0
    # Cost of one proposal whatever its length (a block drafter's one forward), same units.
    cost_per_step: float = 0.0
    # Whether drafting needs a model forward (no free "shadow" checks while speculation is off).
    uses_model: bool = False
    # Whether it drafts from the target's hidden states (MTP heads): then the engine passes
    # them, one row per committed position, in order.
    needs_hidden: bool = False
    # The deepest draft it can make (a block drafter's block less its first token); None: any.
    depth_cap: int | None = None
    # Whether draft trees are tried unless asked otherwise (the cost model still decides).
    trees_by_default: bool = False
    # Target layers whose outputs make those rows (DFlash); None: the final-norm hidden state.
    capture_layers: tuple[int, ...] | None = None
    # Whether a probe (gates.probe) may run while a plain step is in flight, the target a token
    # ahead of the committed ones: true where a proposal does not read that step's rows or
    # cache (an MTP head takes its pending rows in order, a draft model reads neither)
    probes_in_flight: bool = False
    # Whether a batch's rows with this drafter draft in one call (:meth:`propose_together`)
    drafts_together: bool = False

    def start(self, prompt: list[int], resume=None, at: int = 0) -> None:
        """A new request with this prompt begins. The target's cache already holds
        ``prompt[:at]`` (restored from a cached prefix); ``resume`` is what this drafter's
        :meth:`snapshot` gave with that cache, or None."""

    def bind_target(self, state) -> None:
        """The target's ``ModelState`` for this request, for drafters that read its cache
        (the Gemma-4 assistant); called before :meth:`start`."""

    def resume_point(self, resume, at: int) -> int:
        """How much of a cached prefix of ``at`` tokens this drafter can start from with
        ``resume`` (the target then restores that many)."""
        return at

    def prefill(self, prompt: list[int], upto: int, hidden: mx.array | None = None) -> None:
        """The target has now fed ``prompt[:upto]``; ``hidden``: its rows for the positions
        fed since the last call (drafters that ``needs_hidden``)."""

    def snapshot(self):
        """This drafter's state over the tokens the target has fed, kept with the target's
        cache for a later request that starts with them; None when there is nothing to keep."""
        return None

    def add_hidden(self, rows: mx.array) -> None:
        """Hidden states of the next committed positions, in order."""

    @abstractmethod
    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> Draft | None:
        """Up to k draft tokens, or None when there is nothing worth proposing."""

    @classmethod
    def propose_together(cls, drafters: list[Drafter], tokens: list[list[int]], ks: list[int],
                         samplings: list[SamplingParams]) -> list[Draft | None]:
        """The proposals of a batch's rows, row i's what ``drafters[i].propose(tokens[i], ks[i],
        samplings[i])`` gives; a drafter whose rows can share forwards overrides it (MTP heads,
        DFlash)."""
        return [d.propose(t, k, s) for d, t, k, s in zip(drafters, tokens, ks, samplings, strict=True)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Host-side proposal without any model work (used for free shadow checks); [] if none."""
        return []

    def peek(self, tokens: list[int], extra: list[int], k: int) -> list[int]:
        """What :meth:`lookup` would propose once ``extra`` follows ``tokens``, changing
        nothing (for queueing the next verify before this one is read); [] if unknown."""
        return []

    def rollback(self, committed: int) -> None:
        """``tokens[:committed]`` are final; forget anything drafted past them."""

    def propose_tree(self, tokens: list[int], k: int, budget: int, sampling: SamplingParams):
        """A draft tree (engine.tree.DraftTree) of at most ``budget`` nodes and depth ``k``, or
        None when this drafter has nothing better than its chain. The default: the chain
        drawn greedily (deterministic, so the tree walk is exact at any temperature) with
        the next best tokens of each position's row as siblings."""
        draft = self.propose(tokens, k, GREEDY)
        if draft is None or draft.rows is None:
            return None
        chain = draft.host_tokens()
        return tree_from_chain_topk(draft.rows, chain, budget)


def joined_rows(parts: list[mx.array]) -> mx.array | None:
    """The target rows a drafter was handed and has not used yet, as one array (PARTS is left
    holding just that array); None when there are none."""
    if not parts:
        return None
    if len(parts) > 1:
        parts[:] = [mx.concatenate(parts)]
    return parts[0]


def sample_chain(logits: mx.array, k: int, sampling: SamplingParams, step) -> Draft:
    """Draw k tokens one after another: each is fed back through ``step(i, token)``, which
    returns the logits for draft position i. Keeps q (the processed rows) at temperature > 0."""
    drafted, logprobs = [], []
    for i in range(k):
        tok, lp = sampling.sample_with_logprobs(logits)
        drafted.append(tok)
        logprobs.append(lp)
        if i + 1 < k:
            logits = step(i + 1, tok.astype(mx.uint32))
    return chain_draft(drafted, logprobs, sampling)


def chain_draft(drafted: list[mx.array], logprobs: list[mx.array], sampling: SamplingParams) -> Draft:
    """The Draft of a chain drawn one token at a time: DRAFTED (1,) each, LOGPROBS the (1, V)
    processed rows they were drawn from (q, kept at temperature > 0)."""
    rows = mx.concatenate(logprobs)
    return Draft(mx.concatenate(drafted).astype(mx.uint32), None if sampling.greedy else rows, rows=rows)
