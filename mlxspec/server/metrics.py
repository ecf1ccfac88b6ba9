"""Counters the server keeps since start, rendered in the Prometheus text format for ``/metrics``.

Kept apart from generation so that what is counted (requests per surface and status, tokens,
drafted and accepted tokens, prefix-cache reuse) is readable in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.prefix_cache import PrefixCache


class Metrics:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = self.drafted = self.accepted = 0
        self.cached_tokens = 0

    def observe(self, surface: str, status: int) -> None:
        self.requests[(surface, status)] = self.requests.get((surface, status), 0) + 1

    def count_generation(self, prompt_tokens: int, completion_tokens: int, drafted: int, accepted: int,
                         cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.drafted += drafted
        self.accepted += accepted
        self.cached_tokens += cached_tokens

    def render(self, queue_depth: int, prompt_cache: PrefixCache | None = None) -> str:
        lines = ["# HELP mlxspec_requests_total Requests answered, by surface and HTTP status.",
                 "# TYPE mlxspec_requests_total counter"]
        for (surface, status), n in sorted(self.requests.items()):
            lines.append(f'mlxspec_requests_total{{surface="{surface}",status="{status}"}} {n}')
        for name, value, what in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens processed."),
            ("completion_tokens_total", self.completion_tokens, "Tokens generated."),
            ("drafted_tokens_total", self.drafted, "Draft tokens proposed to the target."),
            ("accepted_tokens_total", self.accepted, "Draft tokens the target accepted."),
            ("cached_prompt_tokens_total", self.cached_tokens, "Prompt tokens reused from the prefix cache."),
        ):
            lines += [f"# HELP mlxspec_{name} {what}", f"# TYPE mlxspec_{name} counter", f"mlxspec_{name} {value}"]
        rate = self.accepted / self.drafted if self.drafted else 0.0
        lines += ["# HELP mlxspec_acceptance_ratio Accepted over drafted tokens since start.",
                  "# TYPE mlxspec_acceptance_ratio gauge", f"mlxspec_acceptance_ratio {rate:.6f}",
                  "# HELP mlxspec_queue_depth Requests waiting or running.",
                  "# TYPE mlxspec_queue_depth gauge", f"mlxspec_queue_depth {queue_depth}"]
        if prompt_cache is not None:
            lines += prompt_cache_lines(prompt_cache.stats())
        return "\n".join(lines) + "\n"


def prompt_cache_lines(stats: dict) -> list[str]:
    """The prefix cache's gauges and hit counter, from :meth:`PrefixCache.stats`."""
    return ["# HELP mlxspec_prompt_cache_bytes Bytes held by the prefix cache.",
            "# TYPE mlxspec_prompt_cache_bytes gauge", f"mlxspec_prompt_cache_bytes {stats['bytes']}",
            "# HELP mlxspec_prompt_cache_entries Cached prompt prefixes.",
            "# TYPE mlxspec_prompt_cache_entries gauge",
            f"mlxspec_prompt_cache_entries {stats['entries']}",
            "# HELP mlxspec_prompt_cache_hits_total Requests that reused a cached prefix.",
            "# TYPE mlxspec_prompt_cache_hits_total counter",
            f"mlxspec_prompt_cache_hits_total {stats['hits']}"]
