"""Presets: named bundles of drafter, depth cap and gates, and how ``auto`` picks one.

========  ========  =========  =====  =====================================================
preset    drafter   max depth  gates  use
========  ========  =========  =====  =====================================================
auto      (chosen)  (chosen)   on     draft model if given and it fits (a Gemma-4 target's
                                      assistant also when found beside it), else the
                                      model's MTP head, else prompt lookup
mtp       mtp       4          on     the model's own multi-token-prediction head
pld       pld       8          on     prompt lookup: free, wins on repetitive / quoting text
draft     draft     6          on     a small draft model sharing the tokenizer (--draft-model)
assistant assistant 6          on     Gemma 4's assistant drafter (given, or <target>-assistant)
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
    Preset("assistant", "assistant", DEFAULT_MAX_DEPTH["assistant"], True,
           "a Gemma-4 target's assistant drafter (--draft-model, or <target>-assistant in the cache)"),
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
    draft_is_assistant: bool = False  # the draft model is a Gemma-4 assistant
    draft_found: str | None = None  # a reference to the assistant found beside the target (none given)


def folder_bytes(path: Path) -> int | None:
    """Bytes of a checkpoint's weight files (what loading it puts in memory)."""
    try:
        files = list(Path(path).glob("*.safetensors"))
        return sum(f.stat().st_size for f in files) or None
    except OSError:
        return None


def assistant_beside(path: Path, name: str) -> tuple[Path, str] | None:
    """The assistant of the Gemma-4 target at PATH (called NAME), when one is on disk: the repo
    ``NAME-assistant`` in the Hugging Face cache, or a folder ``<folder>-assistant`` next to
    the target's; None otherwise (or when PATH is no Gemma-4 target)."""
    from .models.gemma4_pairs import ASSISTANT_SUFFIX, is_assistant_folder, is_gemma4_target, read_config
    from .models.loader import resolve_model

    if not is_gemma4_target(read_config(path)):
        return None
    path = Path(path)
    # a local folder: <folder>-assistant next to it; a cached repo (.../snapshots/<hash>): NAME-assistant
    ref = str(path.parent / (path.name + ASSISTANT_SUFFIX)) if path.name == name else name + ASSISTANT_SUFFIX
    try:
        found, found_name, _ = resolve_model(ref)
    except MlxspecError:
        return None
    return (found, found_name) if is_assistant_folder(found) else None


def model_caps(model: str | None, draft_model: str | None = None, look_for_mtp: bool = True,
               look_for_assistant: bool = True) -> ModelCaps:
    """ModelCaps for a model reference (and an optional draft model reference; without one, a
    Gemma-4 target's assistant found beside it when ``look_for_assistant``)."""
    import json

    from .models.gemma4_pairs import is_assistant_folder
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
        caps.draft_is_assistant = is_assistant_folder(dpath)
    elif look_for_assistant:
        found = assistant_beside(path, name)
        if found is not None:
            dpath, caps.draft_name = found
            caps.draft_found = str(dpath)
            caps.draft_bytes, caps.draft_is_assistant = folder_bytes(dpath), True
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
        what = "Gemma-4 assistant" if caps.draft_is_assistant else "draft model"
        how = "found beside the target" if caps.draft_found else "given"
        if fits:
            pick = PRESETS["assistant" if caps.draft_is_assistant else "draft"]
            reasons.append(f"{what} {caps.draft_name} {how} and fits ({numbers})")
        else:
            reasons.append(f"{what} {caps.draft_name} refused: {numbers}")
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
    if name == "assistant" and (caps is None or not caps.draft_is_assistant):
        raise UsageError("--preset assistant needs a Gemma-4 assistant: --draft-model PATH_OR_REPO, "
                         "or <target>-assistant in the Hugging Face cache")
    if name == "draft" and caps is not None and caps.draft_is_assistant and not caps.draft_found:
        raise UsageError("the draft model is a Gemma-4 assistant: use --preset assistant (or auto)")
    if name in ("draft", "assistant"):
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
    # a Gemma-4 target's assistant beside it is used where auto (or the assistant) is asked for
    look = draft_model is None and (preset in ("auto", "assistant") or
                                    (preset is None and drafter in ("auto", "assistant")))
    with contextlib.suppress(MlxspecError):  # an unknown model fails with its own message when loaded
        caps = model_caps(model, draft_model, look_for_mtp=preset == "auto", look_for_assistant=look)
    chosen = reasons = None
    notes, load_bytes, options = [], None, {}
    if preset is not None:
        chosen, reasons = resolve(preset, profile, caps or ModelCaps(draft_name=draft_model))
        if preset == "auto" and chosen.drafter not in ("draft", "assistant") and caps is not None:
            caps = replace(caps, draft_bytes=None)  # a refused draft model will not be loaded
    if caps is not None and caps.draft_found and caps.draft_bytes:
        fits, numbers = draft_fits(profile, caps)
        if preset is not None or fits:
            draft_model = caps.draft_found
            if preset is None:
                notes.append(f"drafting with the Gemma-4 assistant {caps.draft_name} found beside the target")
        else:
            notes.append(f"the Gemma-4 assistant {caps.draft_name} found beside the target is not used: {numbers}")
            caps = replace(caps, draft_bytes=None)
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
            if chosen.drafter not in ("draft", "assistant"):
                draft_model = None  # refused (or not needed): do not load it
        else:
            if chosen.max_depth:  # a cap: a depth `mlxspec tune` chose below it is kept
                options["max_depth"] = chosen.max_depth
            drafter = chosen.drafter
    return RunPlan(drafter, draft_model, options, notes, profile, load_bytes)
