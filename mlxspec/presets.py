"""Presets: named bundles of drafter, depth cap and gates, and how ``auto`` picks one.

========  ========  =========  =====  =====================================================
preset    drafter   max depth  gates  use
========  ========  =========  =====  =====================================================
auto      (chosen)  (chosen)   on     draft model if given and it fits, else the model's MTP
                                      head, else prompt lookup
mtp       mtp       4          on     the model's own multi-token-prediction head
pld       pld       8          on     prompt lookup: free, wins on repetitive / quoting text
draft     draft     6          on     a small draft model sharing the tokenizer (--draft-model)
off       none      -          off    plain decoding, no speculation
========  ========  =========  =====  =====================================================

``max_depth`` caps the adaptive depth (the gates pick the depth per step from measured
acceptance and this machine's verify cost; a depth ``mlxspec tune`` chose lowers the cap);
``gates`` turns that adaptive on/off switching on. ``auto`` runs the engine's own ``auto``
drafter, which picks as :func:`choose` does unless a tune record rated another drafter faster.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import hardware
from .errors import MlxspecError, ModelNotFoundError, UsageError
from .hardware import Profile
from .options import DEFAULT_MAX_DEPTH, check_choice
from .units import human_bytes


class DoesNotFitError(MlxspecError):
    """A model (or target + draft) does not fit the machine's working set."""


@dataclass(frozen=True)
class Preset:
    name: str
    drafter: str  # one of mlxspec.options.DRAFTERS
    max_depth: int | None
    gates: bool
    description: str


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("auto", "auto", None, True,
           "pick from the model and machine: a draft model if given and it fits the working set, "
           "else the model's MTP head, else prompt lookup"),
    Preset("mtp", "mtp", DEFAULT_MAX_DEPTH["mtp"], True, "the model's native multi-token-prediction head"),
    Preset("pld", "pld", DEFAULT_MAX_DEPTH["pld"], True, "prompt lookup: free drafts copied from the context"),
    Preset("draft", "draft", DEFAULT_MAX_DEPTH["draft"], True,
           "a small draft model sharing the tokenizer (needs --draft-model)"),
    Preset("off", "none", None, False, "plain decoding, no speculation"),
)}

# share of the memory budget target + draft may take: the KV cache and activations need the rest
HEADROOM = 0.9


@dataclass
class ModelCaps:
    """What a model offers for speculation, read from its files (nothing is loaded)."""

    name: str | None = None
    model_bytes: int | None = None
    has_mtp_head: bool = False
    mtp_why_not: str | None = None
    draft_name: str | None = None
    draft_bytes: int | None = None


def folder_bytes(path: Path) -> int | None:
    """Bytes of a checkpoint's weight files (what loading it puts in memory)."""
    try:
        files = list(Path(path).glob("*.safetensors"))
        return sum(f.stat().st_size for f in files) or None
    except OSError:
        return None


def model_caps(model: str | None, draft_model: str | None = None, look_for_mtp: bool = True) -> ModelCaps:
    """ModelCaps for a model reference (and an optional draft model reference)."""
    import json

    from .models.loader import resolve_model

    path, name, _ = resolve_model(model)
    caps = ModelCaps(name=name, model_bytes=folder_bytes(path))
    if draft_model is not None:
        try:
            dpath, caps.draft_name, _ = resolve_model(draft_model)
        except ModelNotFoundError as err:  # say which of the two models
            text = str(err)
            raise ModelNotFoundError(f"draft {text}" if text.startswith("model ") else f"draft model: {text}") from None
        caps.draft_bytes = folder_bytes(dpath)
    if not look_for_mtp:
        caps.mtp_why_not = "not looked for"
        return caps
    try:
        config = json.loads((path / "config.json").read_text())
        from .models.mtp.weights import find_mtp_weights

        caps.has_mtp_head = find_mtp_weights(path, config) is not None
        caps.mtp_why_not = None if caps.has_mtp_head else "the checkpoint has no MTP head"
    except MlxspecError as err:
        caps.mtp_why_not = str(err)
    except (OSError, ValueError) as err:
        caps.mtp_why_not = f"cannot read config.json: {err}"
    return caps


def draft_fits(profile: Profile, caps: ModelCaps) -> tuple[bool, str]:
    """Whether target + draft fit the memory budget, and the numbers as one line."""
    budget = profile.memory_budget_bytes
    if not budget or not caps.model_bytes or not caps.draft_bytes:
        return True, "draft model size or memory budget unknown, not checked"
    total = caps.model_bytes + caps.draft_bytes
    limit = int(budget * HEADROOM)
    numbers = (f"target {human_bytes(caps.model_bytes)} + draft {human_bytes(caps.draft_bytes)} = "
               f"{human_bytes(total)} {'<=' if total <= limit else '>'} {int(HEADROOM * 100)}% of the "
               f"{profile.memory_budget_name} ({human_bytes(limit)} of {human_bytes(budget)})")
    return total <= limit, numbers


def _bandwidth_note(profile: Profile, caps: ModelCaps) -> str | None:
    if profile.bandwidth_gbs and caps.model_bytes:
        ceiling = profile.bandwidth_gbs * 1e9 / caps.model_bytes
        return (f"{human_bytes(caps.model_bytes)} at {profile.bandwidth_gbs:g} GB/s caps plain decoding "
                f"near {ceiling:.0f} tok/s, so tokens per target pass are what speculation adds")
    return None


def choose(profile: Profile, caps: ModelCaps) -> tuple[Preset, list[str]]:
    """What ``auto`` picks for this model on this machine, and why (short reasons)."""
    reasons: list[str] = []
    pick = None
    if caps.draft_name is not None:
        fits, numbers = draft_fits(profile, caps)
        if fits:
            pick = PRESETS["draft"]
            reasons.append(f"draft model {caps.draft_name} given and fits ({numbers})")
        else:
            reasons.append(f"draft model {caps.draft_name} refused: {numbers}")
    if pick is None and caps.has_mtp_head:
        pick = PRESETS["mtp"]
        reasons.append("the model has an MTP head")
    if pick is None:
        pick = PRESETS["pld"]
        why = caps.mtp_why_not or "the checkpoint has no MTP head"
        reasons.append(f"no usable draft model or MTP head ({why}): prompt lookup, gated off when it misses")
    note = _bandwidth_note(profile, caps)
    if note:
        reasons.append(note)
    return pick, reasons


def resolve(name: str, profile: Profile | None = None, caps: ModelCaps | None = None
            ) -> tuple[Preset, list[str]]:
    """A preset by name; ``auto`` resolved with choose(); ``draft`` refused when it does not fit."""
    check_choice("preset", name, PRESETS)
    if name == "auto":
        if profile is None or caps is None:
            return PRESETS["auto"], []
        return choose(profile, caps)
    preset = PRESETS[name]
    if name == "draft":
        if caps is None or caps.draft_name is None:
            raise UsageError("--preset draft needs --draft-model PATH_OR_REPO")
        if profile is not None:
            fits, numbers = draft_fits(profile, caps)
            if not fits:
                raise DoesNotFitError(f"draft model {caps.draft_name} does not fit: {numbers}")
    return preset, [preset.description]


@dataclass(frozen=True)
class RunPlan:
    """What a preset decides for one run or server: the drafter, the draft model still to load,
    extra ``GenerationRequest`` fields (gates, max_depth), and notes for the user in the order
    they were decided (memory warning, auto's choice, a --drafter overriding the preset)."""

    drafter: str
    draft_model: str | None
    stream_options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    profile: Profile | None = None
    load_bytes: int | None = None  # weights about to be loaded: the target and a kept draft model

    def apply_memory_limits(self) -> None:
        """Wire memory for the weights about to be loaded (Metal only; never raises)."""
        if self.load_bytes:
            hardware.apply_memory_limits(self.load_bytes, self.profile)


def plan_run(preset: str | None, model: str | None, drafter: str, draft_model: str | None,
             drafter_given: bool = False) -> RunPlan:
    """PRESET (None: no preset) applied to this machine and MODEL: the drafter and depth cap to
    use, whether DRAFT_MODEL is still loaded, and a warning when the weights exceed memory.
    ``drafter_given``: DRAFTER was asked for explicitly, so it wins over the preset's."""
    profile = hardware.detect(fast=True)
    caps = None
    with contextlib.suppress(MlxspecError):  # an unknown model fails with its own message when loaded
        caps = model_caps(model, draft_model, look_for_mtp=preset == "auto")
    chosen = reasons = None
    if preset is not None:
        chosen, reasons = resolve(preset, profile, caps or ModelCaps(draft_name=draft_model))
        if preset == "auto" and chosen.drafter != "draft" and caps is not None:
            caps = replace(caps, draft_bytes=None)  # a refused draft model will not be loaded
    notes, load_bytes, options = [], None, {}
    if caps is not None and caps.model_bytes:
        load_bytes = caps.model_bytes + (caps.draft_bytes or 0)
        name = caps.name if not caps.draft_bytes else f"{caps.name} with its draft model"
        warning = hardware.memory_warning(load_bytes, profile, name)
        if warning:
            notes.append(warning)
    if preset is not None:
        if preset == "auto":
            notes.append(f"preset auto -> {chosen.name}: {'; '.join(reasons)}")
        options["gates"] = chosen.gates
        if drafter_given:
            if drafter != chosen.drafter:
                notes.append(f"note: --drafter {drafter} overrides preset {chosen.name}'s drafter {chosen.drafter}")
        elif preset == "auto":
            # the engine's auto picks what choose() did (draft model kept, else MTP head, else
            # prompt lookup), unless `mlxspec tune` rated another drafter faster on this machine
            drafter = "auto"
            if chosen.drafter != "draft":
                draft_model = None  # refused (or not needed): do not load it
        else:
            if chosen.max_depth:  # a cap: a depth `mlxspec tune` chose below it is kept
                options["max_depth"] = chosen.max_depth
            drafter = chosen.drafter
    return RunPlan(drafter, draft_model, options, notes, profile, load_bytes)
