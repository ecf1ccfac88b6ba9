"""What a stored ``mlxspec tune`` record decides for a run: which drafter ``auto`` runs (the
best rated of those this run can use) and each drafter's depth cap (the tuned depth), with one
line for the user when the record changed ``auto``'s pick or rated another drafter above the
one asked for.

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
