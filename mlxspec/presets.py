"""Presets: named bundles of drafter, depth cap and gates, and how ``auto`` picks one.

========  ========  =========  =====  =====================================================
preset    drafter   max depth  gates  use
========  ========  =========  =====  =====================================================
auto      (chosen)  (chosen)   on     a draft model if given and it fits, else a drafter
                                      found beside the target that fits (a DFlash drafter,
                                      a Gemma-4 target's assistant), else the model's MTP
                                      head, else prompt lookup
mtp       mtp       4          on     the model's own multi-token-prediction head
pld       pld       8          on     prompt lookup: free, wins on repetitive / quoting text
draft     draft     6          on     a small draft model sharing the tokenizer (--draft-model)
assistant assistant 6          on     Gemma 4's assistant drafter (given, or <target>-assistant)
dflash    dflash    15         on     a DFlash block drafter made for the target (given, or
                                      <Target>-DFlash* beside it or in the cache)
off       none      -          off    plain decoding, no speculation
========  ========  =========  =====  =====================================================

``auto``'s order: a draft model the user gave is what they asked for, whatever its kind. Else
a DFlash drafter found beside the target: it drafts a whole block (up to block_size - 1
tokens) in one forward from the target's own hidden features, so a deep draft costs one small
pass and follows the target closely; a Gemma-4 assistant also reads the target's state but
drafts a token per pass. Then the model's MTP head (the target's own features, a few tokens
deep), and last prompt lookup (free, but it only wins where the text repeats the context).

``max_depth`` caps the adaptive depth (the gates pick the depth per step from measured
acceptance and this machine's verify cost; a depth ``mlxspec tune`` chose lowers the cap);
``gates`` turns that adaptive on/off switching on. ``auto`` runs the engine's own ``auto``
drafter, which picks as :func:`choose` does unless a tune record rated another drafter faster.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import hardware
from .errors import MlxspecError, ModelNotFoundError, UsageError
from .hardware import Profile
from .options import BATCH_ROW_CONTEXT, DEFAULT_MAX_BATCH_CAP, DEFAULT_MAX_DEPTH, check_choice
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
           "else a DFlash drafter or Gemma-4 assistant found beside the model, else the model's MTP "
           "head, else prompt lookup"),
    Preset("mtp", "mtp", DEFAULT_MAX_DEPTH["mtp"], True, "the model's native multi-token-prediction head"),
    Preset("pld", "pld", DEFAULT_MAX_DEPTH["pld"], True, "prompt lookup: free drafts copied from the context"),
    Preset("draft", "draft", DEFAULT_MAX_DEPTH["draft"], True,
           "a small draft model sharing the tokenizer (needs --draft-model)"),
    Preset("assistant", "assistant", DEFAULT_MAX_DEPTH["assistant"], True,
           "a Gemma-4 target's assistant drafter (--draft-model, or <target>-assistant in the cache)"),
    Preset("dflash", "dflash", DEFAULT_MAX_DEPTH["dflash"], True,
           "a DFlash block drafter made for the model: a block of drafts per forward from the model's "
           "own features (--draft-model, or <Model>-DFlash* beside it or in the cache)"),
    Preset("off", "none", None, False, "plain decoding, no speculation"),
)}

# share of the memory budget target + draft may take: the KV cache and activations need the rest
HEADROOM = 0.9

# what each kind of draft checkpoint is called, and the drafter (and preset) that runs it
DRAFT_KINDS = {"model": "draft model", "assistant": "Gemma-4 assistant", "dflash": "DFlash drafter"}
DRAFTER_OF_KIND = {"model": "draft", "assistant": "assistant", "dflash": "dflash"}
DRAFT_DRAFTERS = tuple(DRAFTER_OF_KIND.values())  # the drafters that load a draft checkpoint
BESIDE_KINDS = ("dflash", "assistant")  # drafters found beside a target, in auto's order
DFLASH_MARK = "-dflash"  # z-lab/Qwen3-8B-DFlash-b16 drafts for Qwen/Qwen3-8B (any org, any block size)
# a converted target's suffix: mlx-community/Qwen3-8B-4bit is Qwen3-8B to its drafter's name
CONVERTED_SUFFIX = re.compile(r"(-mlx)?(-(\d+bit|bf16|fp16|bfloat16|float16|mxfp4|nvfp4)([-_][a-z0-9]+)?)?$", re.I)


class NotAModelError(UsageError):
    """The model given is a drafter-only checkpoint (a DFlash drafter, a Gemma-4 assistant)."""


@dataclass
class ModelCaps:
    """What a model offers for speculation, read from its files (nothing is loaded)."""

    name: str | None = None
    model_bytes: int | None = None
    has_mtp_head: bool = False
    mtp_why_not: str | None = None
    draft_name: str | None = None
    draft_bytes: int | None = None
    draft_kind: str | None = None  # a key of DRAFT_KINDS: "model", "assistant" or "dflash"
    draft_found: str | None = None  # a reference to the drafter found beside the target (none given)

    @property
    def draft_is_assistant(self) -> bool:
        return self.draft_kind == "assistant"


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


def base_name(name: str) -> str:
    """A model's name part without a converted target's suffix: mlx-community/Qwen3-8B-4bit -> Qwen3-8B."""
    return CONVERTED_SUFFIX.sub("", name.rstrip("/").rsplit("/", 1)[-1])


def dflash_names(name: str) -> tuple[str, ...]:
    """How the names of the DFlash drafters of target NAME start, lower-case: its name part
    with ``-dflash`` (``qwen3-8b-4bit-dflash``), also with a converted target's suffix left
    out (mlx-community/Qwen3-8B-4bit -> ``qwen3-8b-dflash``)."""
    part = name.rstrip("/").rsplit("/", 1)[-1]
    return tuple(dict.fromkeys(s.lower() + DFLASH_MARK for s in (part, base_name(part)) if s))


def _dflash_candidates(path: Path, name: str) -> list[str]:
    """References to try, in order: sibling folders ``<folder>-DFlash*`` of a local target,
    then cached repos (any org) named ``<name part>-DFlash*``."""
    from .hub import cached_repo_ids

    starts = dflash_names(name)
    refs = []
    if path.name == name:  # a local folder (a cached repo's folder is its snapshot's hash)
        with contextlib.suppress(OSError):
            refs += [str(p) for p in sorted(path.parent.iterdir(), key=lambda p: p.name.lower())
                     if p.is_dir() and p.name.lower().startswith(starts)]
    return refs + [r for r in cached_repo_ids() if r.rsplit("/", 1)[-1].lower().startswith(starts)]


def dflash_beside(path: Path, name: str) -> tuple[Path, str] | None:
    """The DFlash drafter of the target at PATH (called NAME) on disk, by name (see
    :func:`_dflash_candidates`) and config: one made for a target of this width and depth
    (``hidden_size``, ``num_target_layers``; one made for another target would be refused when
    loaded, so it is passed over). None when there is none."""
    from .hub import drafter_kind
    from .models.gemma4_pairs import read_config
    from .models.loader import resolve_model

    path = Path(path)
    target = read_config(path) or {}
    target = target["text_config"] if isinstance(target.get("text_config"), dict) else target
    wanted = {"hidden_size": target.get("hidden_size"), "num_target_layers": target.get("num_hidden_layers")}
    for ref in _dflash_candidates(path, name):
        try:
            found, found_name, _ = resolve_model(ref)
        except MlxspecError:
            continue
        config = read_config(found)
        if drafter_kind(config) == "dflash" and all(v is None or config.get(k) == v for k, v in wanted.items()):
            return found, found_name
    return None


def drafter_beside(path: Path, name: str, kinds=BESIDE_KINDS) -> tuple[Path, str, str] | None:
    """The first drafter of KINDS ("dflash", "assistant") found beside the target at PATH
    (called NAME): (folder, name, kind), or None."""
    for kind in kinds:
        found = (dflash_beside if kind == "dflash" else assistant_beside)(path, name)
        if found is not None:
            return (*found, kind)
    return None


def model_caps(model: str | None, draft_model: str | None = None, look_for_mtp: bool = True,
               look_beside=BESIDE_KINDS, *, look_for_assistant: bool | None = None) -> ModelCaps:
    """ModelCaps for a model reference and an optional draft model reference; without one, a
    drafter of the kinds LOOK_BESIDE found beside the model (:func:`drafter_beside`; ``()``
    looks for none; ``look_for_assistant=False``, the older switch, too). NotAModelError when
    MODEL is a drafter-only checkpoint."""
    import json

    from .hub import drafter_kind
    from .models.gemma4_pairs import read_config
    from .models.loader import resolve_model

    path, name, _ = resolve_model(model)
    kind = drafter_kind(read_config(path))
    if kind is not None:
        raise NotAModelError(f"{name} is a {DRAFT_KINDS[kind]}, not a model: use it as --draft-model for its target")
    caps = ModelCaps(name=name, model_bytes=folder_bytes(path))
    if look_for_assistant is False:
        look_beside = ()
    if draft_model is not None:
        try:
            dpath, caps.draft_name, _ = resolve_model(draft_model)
        except ModelNotFoundError as err:  # say which of the two models
            text = str(err)
            raise ModelNotFoundError(f"draft {text}" if text.startswith("model ") else f"draft model: {text}") from None
        caps.draft_bytes = folder_bytes(dpath)
        caps.draft_kind = drafter_kind(read_config(dpath)) or "model"
    elif look_beside:
        found = drafter_beside(path, name, look_beside)
        if found is not None:
            dpath, caps.draft_name, caps.draft_kind = found
            caps.draft_found, caps.draft_bytes = str(dpath), folder_bytes(dpath)
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
    """What ``auto`` picks for this model on this machine, and why (short reasons): the draft
    model given, else the drafter found beside the model (whichever kind: it is the preset of
    that name), if it fits; else the MTP head; else prompt lookup (the module's docstring says why)."""
    reasons: list[str] = []
    pick = None
    if caps.draft_name is not None:
        kind = caps.draft_kind or "model"
        fits, numbers = draft_fits(profile, caps)
        what = DRAFT_KINDS[kind]
        how = "found beside the target" if caps.draft_found else "given"
        if fits:
            pick = PRESETS[DRAFTER_OF_KIND[kind]]
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


def default_max_batch(budget_bytes: int | None, model_bytes: int, kv_bytes_per_token: int) -> tuple[int, str]:
    """Requests `serve` decodes together by default, and why: rows of BATCH_ROW_CONTEXT
    tokens of KV cache in half the memory the weights leave, at most DEFAULT_MAX_BATCH_CAP."""
    if not budget_bytes or kv_bytes_per_token <= 0:
        return 1, "memory unknown"
    room = (budget_bytes - model_bytes) // 2
    per_row = kv_bytes_per_token * BATCH_ROW_CONTEXT
    rows = max(1, min(DEFAULT_MAX_BATCH_CAP, room // per_row))
    return int(rows), (f"{human_bytes(max(room, 0))} for KV caches of {human_bytes(per_row)} a "
                       f"{BATCH_ROW_CONTEXT}-token row")


def how_to_get_dflash(name: str | None) -> str:
    """One line: how to get a DFlash drafter for the model called NAME."""
    return (f"`mlxspec pull z-lab/{base_name(name) if name else '<Model>'}-DFlash-b16` (where z-lab "
            "publishes one for it), or --draft-model PATH_OR_REPO")


def _refuse_wrong_kind(name: str, caps: ModelCaps | None) -> None:
    """--preset assistant / dflash without a draft of that kind; --preset draft with one."""
    kind = caps.draft_kind if caps is not None else None
    if name == "assistant" and kind != "assistant":
        raise UsageError("--preset assistant needs a Gemma-4 assistant: --draft-model PATH_OR_REPO, "
                         "or <target>-assistant in the Hugging Face cache")
    if name == "dflash" and kind != "dflash":
        given = f" ({caps.draft_name} is a {DRAFT_KINDS[kind]})" if kind and caps.draft_name else ""
        raise UsageError(f"--preset dflash needs a DFlash drafter made for the model{given}: "
                         + how_to_get_dflash(caps.name if caps is not None else None))
    if name == "draft" and kind in BESIDE_KINDS and not caps.draft_found:
        raise UsageError(f"the draft model is a {DRAFT_KINDS[kind]}: use --preset {kind} (or auto)")


def check_drafter_kind(drafter: str, caps: ModelCaps | None) -> None:
    """Refuse, before anything is loaded, a drafter that cannot run the draft checkpoint given
    or found (--drafter dflash with a plain draft model, --drafter draft with a DFlash drafter);
    the engine says the same once loaded."""
    kind = caps.draft_kind if caps is not None and caps.draft_name is not None else None
    if kind is None or drafter not in DRAFT_DRAFTERS or drafter == DRAFTER_OF_KIND[kind]:
        return
    if drafter == "draft":
        raise UsageError(f"the draft model is a {DRAFT_KINDS[kind]}: use --drafter {kind} (or auto)")
    raise UsageError(f"--drafter {drafter} needs --draft-model pointing at a {DRAFT_KINDS[drafter]} "
                     f"checkpoint; {caps.draft_name} is a {DRAFT_KINDS[kind]}")


def resolve(name: str, profile: Profile | None = None, caps: ModelCaps | None = None
            ) -> tuple[Preset, list[str]]:
    """A preset by name; ``auto`` resolved with choose(); ``draft`` (``assistant``, ``dflash``)
    refused without a draft of its kind or when it does not fit."""
    check_choice("preset", name, PRESETS)
    if name == "auto":
        if profile is None or caps is None:
            return PRESETS["auto"], []
        return choose(profile, caps)
    preset = PRESETS[name]
    _refuse_wrong_kind(name, caps)
    if name in DRAFT_DRAFTERS:
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


def _looked_for(preset: str | None, drafter: str, draft_model: str | None, drafter_given: bool) -> tuple:
    """The kinds of drafter to look for beside the target: those auto, ``assistant`` or
    ``dflash`` asks for (the drafter when given or without a preset, else the preset), none
    when a draft model is given."""
    asked = drafter if drafter_given or preset is None else preset
    if draft_model is not None:
        return ()
    return BESIDE_KINDS if asked == "auto" else (asked,) if asked in BESIDE_KINDS else ()


def _use_found(caps: ModelCaps, profile: Profile, notes: list[str]):
    """(caps, draft model) once a drafter found beside the target is taken (it fits the
    memory budget) or left out (its bytes are then not loaded)."""
    fits, numbers = draft_fits(profile, caps)
    what = f"the {DRAFT_KINDS[caps.draft_kind]} {caps.draft_name}"
    if fits:
        notes.append(f"drafting with {what} found beside the target")
        return caps, caps.draft_found
    notes.append(f"{what} found beside the target is not used: {numbers}")
    return replace(caps, draft_bytes=None), None


def plan_run(preset: str | None, model: str | None, drafter: str, draft_model: str | None,
             drafter_given: bool = False) -> RunPlan:
    """PRESET (None: no preset) applied to this machine and MODEL: the drafter and depth cap to
    use, whether DRAFT_MODEL is still loaded (or a drafter found beside MODEL is), and a
    warning when the weights exceed memory. ``drafter_given``: DRAFTER was asked for
    explicitly, so it wins over the preset's. NotAModelError when MODEL is a drafter."""
    profile = hardware.detect(fast=True)
    caps = None
    look = _looked_for(preset, drafter, draft_model, drafter_given)
    try:
        caps = model_caps(model, draft_model, look_for_mtp=preset == "auto", look_beside=look)
    except NotAModelError:
        raise
    except MlxspecError:  # an unknown model fails with its own message when loaded
        pass
    chosen = reasons = None
    notes, load_bytes, options = [], None, {}
    if preset is not None:
        chosen, reasons = resolve(preset, profile, caps or ModelCaps(draft_name=draft_model))
        if preset == "auto" and chosen.drafter not in DRAFT_DRAFTERS and caps is not None:
            caps = replace(caps, draft_bytes=None)  # a refused draft model will not be loaded
    if caps is not None and caps.draft_found and caps.draft_bytes:
        caps, draft_model = _use_found(caps, profile, notes)
    if caps is not None and caps.model_bytes:
        from .models.sharding import world

        group = world()  # under mlx.launch each machine holds its shard of the target, the draft whole
        load_bytes = caps.model_bytes // (group.size() if group is not None else 1) + (caps.draft_bytes or 0)
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
            if chosen.drafter not in DRAFT_DRAFTERS:
                draft_model = None  # refused (or not needed): do not load it
        else:
            if chosen.max_depth:  # a cap: a depth `mlxspec tune` chose below it is kept
                options["max_depth"] = chosen.max_depth
            drafter = chosen.drafter
    check_drafter_kind(drafter, caps)
    return RunPlan(drafter, draft_model, options, notes, profile, load_bytes)
