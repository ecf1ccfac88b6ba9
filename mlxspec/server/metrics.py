"""Counters the server keeps since start, rendered in the Prometheus text format for ``/metrics``.

Kept apart from generation so that what is counted (requests per surface and status, tokens,
prefix-cache reuse, and speculation: per drafter and per draft position, verify and plain steps,
queued verifies) is readable in one place. The speculation counters follow vLLM's names
(``spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos``, positions from 0) so the same queries work: the acceptance
rate is ``rate(accepted_tokens) / rate(draft_tokens)`` and the mean acceptance length (tokens
committed per verify, the target's own included) ``1 + rate(accepted_tokens) / rate(drafts)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.prefix_cache import PrefixCache
    from ..engine.stats import Stats


@dataclass
class DrafterCounts:
    """One drafter's speculation since start, summed over requests."""

    drafts: int = 0  # verifies that checked at least one drafted token
    draft_tokens: int = 0
    accepted: int = 0
    tree_steps: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts that reached position i
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted through position i

    def add(self, stats: Stats) -> None:
        self.drafts += stats.verify_steps
        self.draft_tokens += stats.drafted
        self.accepted += stats.accepted
        self.tree_steps += stats.tree_steps
        _add_into(self.drafted_per_pos, list(stats.position_drafted))
        _add_into(self.accepted_per_pos, list(stats.position_accepted))


def _add_into(total: list[int], more: list[int]) -> None:
    total.extend([0] * (len(more) - len(total)))
    for i, n in enumerate(more):
        total[i] += n


def escape_label(value: str) -> str:
    """A label value as the text exposition format writes it: backslash, quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def labels(**kw) -> str:
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in kw.items()) + "}"


def family(name: str, kind: str, what: str, samples: list[tuple[str, int | float]]) -> list[str]:
    """HELP and TYPE lines of metric NAME, then one line per (label set, value) sample."""
    return [f"# HELP {name} {what}", f"# TYPE {name} {kind}"] + [f"{name}{lab} {v}" for lab, v in samples]


class Metrics:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.verify_steps = self.plain_steps = self.queued_used = self.queued_dropped = 0
        # each request's tokens after its first, and the seconds they took: their rates' ratio
        # is the tok/s one request sees (a batch row's, or a request's alone)
        self.decode_tokens, self.decode_seconds = 0, 0.0
        self.drafters: dict[str, DrafterCounts] = {}  # drafted and accepted are their sums

    @property
    def drafted(self) -> int:
        return sum(c.draft_tokens for c in self.drafters.values())

    @property
    def accepted(self) -> int:
        return sum(c.accepted for c in self.drafters.values())

    def observe(self, surface: str, status: int) -> None:
        self.requests[(surface, status)] = self.requests.get((surface, status), 0) + 1

    def count_generation(self, prompt_tokens: int, completion_tokens: int, stats: Stats) -> None:
        """Count one finished (or cancelled) generation: its tokens and its engine STATS."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cached_tokens += stats.cached_tokens
        self.verify_steps += stats.verify_steps
        self.plain_steps += stats.plain_steps
        self.queued_used += stats.queued_used
        self.queued_dropped += stats.queued_dropped
        if stats.generated_tokens > 1:
            self.decode_tokens += stats.generated_tokens - 1
            self.decode_seconds += stats.decode_time_s
        if stats.verify_steps:
            self.drafters.setdefault(stats.drafter, DrafterCounts()).add(stats)

    def render(self, queue_depth: int, prompt_cache: PrefixCache | None = None, batch: dict | None = None) -> str:
        lines = family("mlxspec_requests_total", "counter", "Requests answered, by surface and HTTP status.",
                       [(labels(surface=s, status=c), n) for (s, c), n in sorted(self.requests.items())])
        for name, value, what in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens processed."),
            ("completion_tokens_total", self.completion_tokens, "Tokens generated."),
            ("drafted_tokens_total", self.drafted, "Draft tokens proposed to the target (all drafters)."),
            ("accepted_tokens_total", self.accepted, "Draft tokens the target accepted (all drafters)."),
            ("cached_prompt_tokens_total", self.cached_tokens, "Prompt tokens reused from the prefix cache."),
            ("verify_steps_total", self.verify_steps,
             "Target forwards that verified at least one drafted token."),
            ("plain_steps_total", self.plain_steps, "Target forwards that decoded one token with nothing drafted."),
            ("request_decode_tokens_total", self.decode_tokens,
             "Tokens each request generated after its first, summed (over request_decode_seconds_total: "
             "the tok/s one request sees)."),
            ("request_decode_seconds_total", round(self.decode_seconds, 6),
             "Seconds from each request's first token to its last, summed."),
        ):
            lines += family(f"mlxspec_{name}", "counter", what, [("", value)])
        lines += family("mlxspec_queued_verifies_total", "counter",
                        "Verifies queued before the step before them was read: used as queued, or dropped.",
                        [(labels(outcome="used"), self.queued_used), (labels(outcome="dropped"), self.queued_dropped)])
        lines += self._drafter_lines()
        rate = self.accepted / self.drafted if self.drafted else 0.0
        lines += family("mlxspec_acceptance_ratio", "gauge", "Accepted over drafted tokens since start.",
                        [("", f"{rate:.6f}")])
        lines += family("mlxspec_queue_depth", "gauge", "Requests waiting or running.", [("", queue_depth)])
        if batch is not None:
            lines += batch_lines(batch)
        if prompt_cache is not None:
            lines += prompt_cache_lines(prompt_cache.stats())
        return "\n".join(lines) + "\n"

    def _drafter_lines(self) -> list[str]:
        """The per-drafter and per-position speculation counters (vLLM's names, mlxspec_ prefix)."""
        ds = sorted(self.drafters.items())

        def per_pos(attr: str) -> list[tuple[str, int]]:
            return [(labels(drafter=d, position=i), n) for d, c in ds for i, n in enumerate(getattr(c, attr))]

        return (
            family("mlxspec_spec_decode_num_drafts_total", "counter",
                   "Verifies of a draft (chain or tree), by drafter.",
                   [(labels(drafter=d), c.drafts) for d, c in ds])
            + family("mlxspec_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed, by drafter.",
                     [(labels(drafter=d), c.draft_tokens) for d, c in ds])
            + family("mlxspec_spec_decode_num_accepted_tokens_total", "counter",
                     "Draft tokens the target accepted, by drafter.", [(labels(drafter=d), c.accepted) for d, c in ds])
            + family("mlxspec_spec_decode_num_draft_tokens_per_pos_total", "counter",
                     "Drafts that reached draft position N (from 0), by drafter.", per_pos("drafted_per_pos"))
            + family("mlxspec_spec_decode_num_accepted_tokens_per_pos_total", "counter",
                     "Drafts accepted through draft position N (from 0), by drafter.", per_pos("accepted_per_pos"))
            + family("mlxspec_spec_decode_tree_steps_total", "counter",
                     "Verifies of a draft tree (counted in num_drafts too), by drafter.",
                     [(labels(drafter=d), c.tree_steps) for d, c in ds])
        )


def prompt_cache_lines(stats: dict) -> list[str]:
    """The prefix cache's gauges and hit counter, from :meth:`PrefixCache.stats`."""
    return (family("mlxspec_prompt_cache_bytes", "gauge", "Bytes held by the prefix cache.", [("", stats["bytes"])])
            + family("mlxspec_prompt_cache_entries", "gauge", "Cached prompt prefixes.", [("", stats["entries"])])
            + family("mlxspec_prompt_cache_hits_total", "counter", "Requests that reused a cached prefix.",
                     [("", stats["hits"])]))


def batch_lines(batch: dict) -> list[str]:
    """The batch's size and its steps: rate(row_steps) / rate(steps) is the mean rows a step."""
    return (family("mlxspec_batch_max_rows", "gauge", "Requests that may decode together (--max-batch).",
                   [("", batch["max_rows"])])
            + family("mlxspec_batch_rows", "gauge", "Requests running now (rows of the batch, or one alone).",
                     [("", batch["rows"])])
            + family("mlxspec_batch_steps_total", "counter", "Batched target forwards.", [("", batch["steps"])])
            + family("mlxspec_batch_row_steps_total", "counter", "Rows those batched forwards decoded, summed.",
                     [("", batch["row_steps"])]))
