"""What a stored ``mlxspec tune`` record decides for a run: which drafter ``auto`` runs (the
best rated of those this run can use, or none when every one was rated slower than plain
decoding) and each drafter's depth cap (the tuned depth), with one line for the user when the
record changed ``auto``'s pick or rated another drafter above the one asked for; and tune's
conclusion in words (:func:`conclusion`).

Pure functions of the record (a dict, see the package doc): no mlx, no timing, so a seeded run
makes the same choice every time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options import MODEL_DRAFTERS


@dataclass(frozen=True)
class TunedChoice:
    drafter: str  # the drafter to run: DEFAULT unless the record rated another one higher
    max_depth: int | None  # the cap of the adaptive depth: the tuned depth, else None (as asked)
    note: str | None = None  # one line for the user, or None


def ratings(record: dict | None, available: list[str], draft_key: str | None = None) -> dict[str, tuple[int, float]]:
    """drafter -> (tuned depth, expected speedup) for the drafters of AVAILABLE the record rated.
    The draft-model drafter counts only when it was tuned with the same draft model (DRAFT_KEY)."""
    out: dict[str, tuple[int, float]] = {}
    depths = (record or {}).get("depth")
    if not isinstance(depths, dict):
        return out
    tuned_draft = ((record or {}).get("draft_model") or {}).get("key")
    for name in available:
        entry = depths.get(name)
        own_model = name in MODEL_DRAFTERS  # tuned with this same draft model only
        if not isinstance(entry, dict) or (own_model and (draft_key is None or tuned_draft != draft_key)):
            continue
        depth, speedup = entry.get("depth"), entry.get("speedup")
        if isinstance(depth, int) and depth >= 1 and isinstance(speedup, (int, float)):
            out[name] = (depth, float(speedup))
    return out


def choose(record: dict | None, requested: str, default: str, available: list[str],
           draft_key: str | None = None) -> TunedChoice:
    """The drafter and depth cap for a run that asked for REQUESTED ("auto" or a drafter) and
    would run DEFAULT without the record; AVAILABLE: the drafters it can run."""
    rated = ratings(record, available, draft_key)
    if default == "none" or not rated:
        return TunedChoice(default, None)
    best = max(rated, key=lambda name: rated[name][1])
    if requested == "auto" and set(available) <= rated.keys() and rated[best][1] < 1.0:
        # every drafter this run has was rated slower than plain decoding here
        return TunedChoice("none", None, f"note: drafter auto -> none: `mlxspec tune` rated no drafter faster "
                                         f"than plain decoding on this machine (best {best} {rated[best][1]:.2f}x)")
    name, note = default, None
    if best != default and rated[best][1] > rated.get(default, (0, 0.0))[1]:
        theirs = f"{best} {rated[best][1]:.2f}x"
        ours = f"{default} {rated[default][1]:.2f}x" if default in rated else f"{default} (not tuned)"
        if requested == "auto":
            name = best
            note = f"note: drafter auto -> {best}: `mlxspec tune` rated {theirs} against {ours} on this machine"
        else:
            note = (f"note: drafter {default} as asked, though `mlxspec tune` rated {theirs} against {ours} "
                    f"on this machine")
    depth = rated[name][0] if name in rated else None
    return TunedChoice(name, depth, note)


def auto_default(drafters: list[str]) -> str:
    """``auto``'s pick among DRAFTERS without a record: a drafter of its own checkpoint (the
    --draft-model), else the MTP head, else prompt lookup."""
    own = [name for name in drafters if name in MODEL_DRAFTERS]
    return own[0] if own else "mtp" if "mtp" in drafters else "pld"


def conclusion(record: dict) -> str:
    """What a tune RECORD means for ``mlxspec run`` with the same model (and draft model), in
    words: the drafter and depth :func:`choose` picks for drafter auto, or plain decoding."""
    depths = record.get("depth") if isinstance(record.get("depth"), dict) else {}
    drafters = list(depths)
    if not drafters:
        return "nothing was tuned; run will use its defaults"
    draft_key = (record.get("draft_model") or {}).get("key")
    rated = ratings(record, drafters, draft_key)
    choice = choose(record, "auto", auto_default(drafters), drafters, draft_key)
    if choice.drafter == "none":
        best = max(rated, key=lambda name: rated[name][1])
        return (f"speculation does not pay on this machine for this model: best {best} {rated[best][1]:.2f}x; "
                "run will use plain decoding")
    if choice.drafter not in rated:
        return (f"no drafter made drafts on the tune prompts; run will use {choice.drafter} at its default depth, "
                "switched off where it does not pay")
    depth, speedup = rated[choice.drafter]
    with_model = " with this --draft-model" if choice.drafter in MODEL_DRAFTERS else ""
    text = f"run will use {choice.drafter}{with_model} at depth {depth} ({speedup:.2f}x"
    if speedup < 1.0:
        return text + " expected: slower than plain decoding; its gates switch speculation off where it does not pay)"
    return text + " expected over plain decoding)"
