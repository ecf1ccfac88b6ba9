"""What the trained-mini tests share: the bench's prompt sets and one decoder run."""

from __future__ import annotations

import json
from pathlib import Path

from mlxspec.engine.speculate import SpeculativeDecoder

WORKLOADS = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads"


def workload_prompts(workload: str, tokenizer, n: int) -> list[list[int]]:
    """The first N prompts of a bench prompt set, tokenized as the bench does (no template)."""
    rows = [json.loads(line) for line in (WORKLOADS / f"{workload}.jsonl").read_text().splitlines()]
    return [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows[:n]]


def run_decoder(model, prompt: list[int], n: int, **kw):
    """(tokens, stats) of N tokens from a gates-off SpeculativeDecoder built with KW (its
    ``prefix_cache``, if any, goes to generate)."""
    out, stats = [], None
    reuse = kw.pop("prefix_cache", None)
    for toks, stats in SpeculativeDecoder(model, gates=False, **kw).generate(prompt, max_tokens=n,
                                                                              prefix_cache=reuse):
        out.extend(toks)
    return out, stats
