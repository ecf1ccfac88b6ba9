"""Which drafter a name stands for, and building it: the one place that knows every drafter."""

from __future__ import annotations

import mlx.nn as nn

from ...errors import DrafterError, UsageError
from ...models.dflash import DFlashDraftModel
from ...models.gemma4_assistant import Gemma4Assistant
from ...models.mtp.head import MTPHead
from ..cache import model_nbytes
from .assistant import AssistantDrafter
from .base import Drafter
from .dflash import DFlashDrafter
from .draft_model import DraftModelDrafter
from .mtp import MTPDrafter
from .pld import PromptLookupDrafter


def resolve_drafter(name: str, draft_model: nn.Module | None, mtp_head: MTPHead | None) -> str:
    """The drafter NAME stands for: ``auto`` is the draft model if given (``assistant`` when it
    is a Gemma-4 assistant, ``dflash`` for a DFlash drafter), else the model's own MTP head,
    else prompt lookup; any other name is itself."""
    if name == "auto":
        if isinstance(draft_model, Gemma4Assistant):
            return "assistant"
        if isinstance(draft_model, DFlashDraftModel):
            return "dflash"
        return "draft" if draft_model is not None else "mtp" if mtp_head is not None else "pld"
    return name


MODEL_KINDS = {"draft": "a draft model", "assistant": "a Gemma-4 assistant", "dflash": "a DFlash drafter"}


def check_drafter(name: str, draft_model: nn.Module | None) -> None:
    """UsageError when the drafter NAME (resolved) cannot run with DRAFT_MODEL's kind: the one
    check, made before anything is timed or built for it."""
    if name not in MODEL_KINDS:
        return
    kind = ("assistant" if isinstance(draft_model, Gemma4Assistant) else
            "dflash" if isinstance(draft_model, DFlashDraftModel) else "draft" if draft_model is not None else None)
    if kind is None:
        raise UsageError(f"--drafter {name} needs --draft-model pointing at {MODEL_KINDS[name]}")
    if kind != name:
        raise UsageError(f"the draft model is {MODEL_KINDS[kind]}: use --drafter {kind} (or auto); "
                         f"--drafter {name} needs {MODEL_KINDS[name]}")


def make_drafter(
    name: str, target: nn.Module, draft_model: nn.Module | None, mtp_head: MTPHead | None = None,
    cost_per_token: float | None = None,
) -> Drafter | None:
    """The drafter NAME resolves to (:func:`resolve_drafter`); ``cost_per_token``, a measured
    cost of one draft step, replaces the drafter's own estimate."""
    name = resolve_drafter(name, draft_model, mtp_head)
    check_drafter(name, draft_model)
    if name == "none":
        return None
    if name == "pld":
        return PromptLookupDrafter(cost_per_token=cost_per_token)
    if name == "draft":
        return DraftModelDrafter(draft_model, model_nbytes(target), cost_per_token)
    if name == "dflash":
        return DFlashDrafter(draft_model, target, model_nbytes(target), cost_per_token)
    if name == "assistant":
        return AssistantDrafter(draft_model, target, model_nbytes(target), cost_per_token)
    if name == "mtp":
        if mtp_head is None:
            raise DrafterError(
                "this model has no MTP head; use --drafter pld, or --drafter draft with --draft-model"
            )
        return MTPDrafter(mtp_head, model_nbytes(target), cost_per_token)
    raise UsageError(f"unknown drafter {name!r}")
