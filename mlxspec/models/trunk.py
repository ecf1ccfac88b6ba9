"""A causal LM cut in two, body (tokens -> final-norm hidden) and head (hidden -> logits):
what MTP heads read (the trunk's hidden states) and share (its embedding and lm_head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.nn as nn

from ..compat import final_softcap
from ..errors import InvalidCheckpointError


@dataclass
class Trunk:
    """A causal LM cut in two: body (tokens -> final-norm hidden) and head (hidden -> logits)."""

    body: Callable
    head: Callable
    embed: nn.Module


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
    softcap = final_softcap(lm)  # Gemma caps its logits after the head
    if softcap is not None:
        plain_head = head
        head = lambda h: softcap(plain_head(h))  # noqa: E731
    return Trunk(body=body, head=head, embed=body.embed_tokens)
