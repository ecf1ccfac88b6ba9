"""Per-request statistics: counts kept by the engine, rates derived on read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GateEvent:
    """A gate switched speculation on or off at output token ``at_token``."""

    at_token: int
    enabled: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"at_token": self.at_token, "enabled": self.enabled, "reason": self.reason}


@dataclass
class Stats:
    drafter: str = "none"
    depth: int = 0
    cost_model: str = "default"  # verify-cost curve the depth choice used: default or measured
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # target forwards that checked at least one drafted token
    plain_steps: int = 0  # target forwards that decoded one token with nothing drafted
    # verifies queued before the step before them was read: used as queued, or dropped
    queued_used: int = 0
    queued_dropped: int = 0
    # model drafters' proposals checked against plain tokens instead of verified (gate evidence
    # while speculation is off or on trial; not counted in drafted/accepted)
    probes: int = 0
    tree_steps: int = 0  # verifies of a draft tree (counted in verify_steps too)
    tree_nodes: int = 0  # draft nodes those trees held
    tree_note: str | None = None  # why chains were verified where trees could have been
    # per draft position i: how often a draft reached position i and how often it was accepted
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    depth_histogram: dict[int, int] = field(default_factory=dict)
    gate_events: list[GateEvent] = field(default_factory=list)
    prompt_time_s: float = 0.0
    decode_time_s: float = 0.0
    ttft_s: float = 0.0
    finish_reason: str | None = None
    _t_start: float = field(default_factory=time.perf_counter, repr=False)

    # -- recording -------------------------------------------------------
    def record_verify(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.depth_histogram[drafted] = self.depth_histogram.get(drafted, 0) + 1
        while len(self.position_drafted) < drafted:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(drafted):
            self.position_drafted[i] += 1
            if i < accepted:
                self.position_accepted[i] += 1

    def record_tree(self, nodes: int) -> None:
        self.tree_steps += 1
        self.tree_nodes += nodes

    def record_gate(self, enabled: bool, reason: str) -> None:
        self.gate_events.append(GateEvent(self.generated_tokens, enabled, reason))

    # -- derived ---------------------------------------------------------
    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per speculative verify (accepted drafts + the target's own token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def mean_depth(self) -> float:
        """Tokens drafted per speculative verify (``depth`` is the cap the gate chose within)."""
        return self.drafted / self.verify_steps if self.verify_steps else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def prompt_tps(self) -> float:
        # tokens actually prefilled: a cached prefix was restored, not computed
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prompt_time_s if self.prompt_time_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of prefill; decode rate counts the ones after it
        n = max(self.generated_tokens - 1, 0)
        return n / self.decode_time_s if self.decode_time_s > 0 else 0.0

    @property
    def speculating(self) -> bool:
        """Whether the last gate decision left speculation on."""
        return self.gate_events[-1].enabled if self.gate_events else self.drafter != "none"

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            "depth": self.depth,
            "cost_model": self.cost_model,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 4),
            "position_acceptance": [round(x, 4) for x in self.position_acceptance],
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "queued_used": self.queued_used,
            "queued_dropped": self.queued_dropped,
            "probes": self.probes,
            "tree_steps": self.tree_steps,
            "tree_nodes": self.tree_nodes,
            "tree_note": self.tree_note,
            "mean_depth": round(self.mean_depth, 3),
            "depth_histogram": {str(k): v for k, v in sorted(self.depth_histogram.items())},
            "prompt_tps": round(self.prompt_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "ttft_s": round(self.ttft_s, 4),
            "gate_events": [e.to_dict() for e in self.gate_events],
            "finish_reason": self.finish_reason,
        }
