"""A causal LM cut in two, body (tokens -> final-norm hidden) and head (hidden -> logits):
what MTP heads read (the trunk's hidden states) and share (its embedding and lm_head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.nn as nn

from ..compat import final_softcap, gather_last_axis, sharding_group
from ..errors import InvalidCheckpointError


@dataclass
class Trunk:
    """A causal LM cut in two: body (tokens -> final-norm hidden) and head (hidden -> logits)."""

    body: Callable
    head: Callable
    embed: nn.Module


class GatheredHead(nn.Module):
    """An lm_head that mlx-lm's ``shard()`` split over the vocabulary, with its logits gathered
    whole on every rank; a module, so its bytes (this rank's rows) are counted as a head's."""

    def __init__(self, head: nn.Module, group):
        super().__init__()
        self.head = head
        self.group = group

    def __call__(self, h):
        return gather_last_axis(self.head(h), self.group)


def split_trunk(model: nn.Module) -> Trunk:
    lm = getattr(model, "language_model", model)  # qwen3_5 wraps a text model
    body = getattr(lm, "model", None)
    args = getattr(lm, "args", None)
    if body is None or not hasattr(body, "embed_tokens"):
        raise InvalidCheckpointError(f"cannot find the trunk of a {type(model).__module__} model")
    if getattr(args, "tie_word_embeddings", False) or not hasattr(lm, "lm_head"):
        head = body.embed_tokens.as_linear
    else:
        head = lm.lm_head
        group = sharding_group(lm)
        if group is not None:  # mlx-lm's shard() split the vocabulary: gather it, as its __call__ does
            head = GatheredHead(lm.lm_head, group)
    softcap = final_softcap(lm)  # Gemma caps its logits after the head
    if softcap is not None:
        plain_head = head
        head = lambda h: softcap(plain_head(h))  # noqa: E731
    return Trunk(body=body, head=head, embed=body.embed_tokens)
