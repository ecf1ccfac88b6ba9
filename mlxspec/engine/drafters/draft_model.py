"""A separate small model with the target's vocabulary drafts a chain of tokens."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...errors import DrafterError
from ..cache import ModelState, RollbackImpossible, model_nbytes
from ..sampling import SamplingParams
from .base import Draft, Drafter, sample_chain


def _vocab_size(model: nn.Module) -> int | None:
    args = getattr(model, "args", None)
    for obj in (args, getattr(args, "text_config", None)):
        if isinstance(obj, dict) and obj.get("vocab_size"):
            return int(obj["vocab_size"])
        if getattr(obj, "vocab_size", None):
            return int(obj.vocab_size)
    return None


def check_compatible(target, draft) -> None:
    """Refuse a draft model whose vocabulary differs from the target's (LoadedModel pair)."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        raise DrafterError(
            f"draft model {draft.name!r} has a different vocabulary from {target.name!r} "
            f"({len(d_vocab)} vs {len(t_vocab)} tokens); use a draft model with the target's tokenizer"
        )
    t_logits, d_logits = _vocab_size(target.model), _vocab_size(draft.model)
    if t_logits and d_logits and t_logits != d_logits:
        raise DrafterError(
            f"draft model {draft.name!r} outputs {d_logits} logits but {target.name!r} "
            f"outputs {t_logits}; their vocabularies must match"
        )


class DraftModelDrafter(Drafter):
    name = "draft"
    uses_model = True
    probes_in_flight = True

    def __init__(self, model: nn.Module, target_nbytes: int | None = None, cost_per_token: float | None = None):
        self.model = model
        self.state = ModelState(model)
        self.state.check_rollback()
        # Without a measured cost (`mlxspec tune`): a forward streams every weight once, so
        # cost relative to the target ~ bytes ratio, plus a fixed share for launch overhead
        # that small models do not amortize.
        if cost_per_token is not None:
            self.cost_per_token = cost_per_token
        elif target_nbytes:
            self.cost_per_token = 0.05 + model_nbytes(model) / target_nbytes
        else:
            self.cost_per_token = 0.2

    def start(self, prompt: list[int], resume=None, at: int = 0) -> None:
        self.state = ModelState(self.model)
        if resume is not None:
            # its own cache may be shorter than the target's (it feeds lazily) or, trimmable,
            # longer: take what is valid for this prompt; the rest is fed below
            n = min(resume.length, at)
            if n == resume.length or resume.trimmable:
                self.state.restore(resume, n)

    def prefill(self, prompt: list[int], upto: int, hidden=None) -> None:
        if upto > self.state.length:
            self.state.prefill(prompt[self.state.length : upto])

    def snapshot(self):
        return self.state.snapshot()

    def propose(self, tokens: list[int], k: int, sampling: SamplingParams) -> Draft | None:
        if k <= 0:
            return None
        missing = mx.array(tokens[self.state.length :], mx.uint32)
        logits = self.state.forward(missing)[-1:]
        return sample_chain(logits, k, sampling, lambda i, tok: self.state.forward(tok))

    def rollback(self, committed: int) -> None:
        try:
            self.state.rollback_to(min(committed, self.state.length))
        except RollbackImpossible:
            # A wrapped sliding window overwritten in place: start over (refed on next propose).
            self.state = ModelState(self.model)
        self.state.commit()
