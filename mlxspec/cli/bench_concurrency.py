"""``mlxspec bench --concurrency``: loading, prompts and output for bench/concurrency.py."""

from __future__ import annotations

from typing import Optional

from ..errors import UsageError
from .console import load_with_spinner, print_note, stdout_console


def run_concurrency(model: Optional[str], draft_model: Optional[str], dtype: Optional[str], levels_text: str,
                    workloads_dir, workloads: Optional[str], prompts: Optional[int], max_tokens: Optional[int],
                    reps: Optional[int], drafter: Optional[str], temperature: float, seed: int,
                    json_path: Optional[str], progress, join_tokens: Optional[int] = None) -> None:
    """PROGRESS: bench's progress context (on_step)."""
    from ..bench.concurrency import measure, parse_levels, render
    from ..bench.prompts import load_workloads, parse_list
    from ..bench.report import write_json
    from ..hub import expand_alias
    from ..options import DRAFTERS

    levels = parse_levels(levels_text)
    drafter = drafter or "auto"
    if drafter not in DRAFTERS:
        raise UsageError(f"--drafter must be one of {', '.join(DRAFTERS)} (got {drafter!r})")
    sets = load_workloads(workloads_dir, parse_list(workloads, "workloads") or ["echo"], prompts, max_tokens)
    spec = load_with_spinner(expand_alias(model) if model else None, expand_alias(draft_model))
    if dtype is not None:
        spec.astype(dtype)
    from ..api import GenerationRequest

    _, why = spec.batch_plan(GenerationRequest(drafter=drafter, temperature=temperature))
    if why:
        raise UsageError(f"--concurrency: {why}")
    requests = [(spec.encode(p.text), p.max_tokens) for w in sets for p in w.prompts]
    with progress("bench") as on_step:
        doc = measure(spec, requests, levels, drafter=drafter, reps=reps or 3, temperature=temperature,
                      seed=seed, join_tokens=join_tokens, on_step=on_step)
    render(doc, stdout_console())
    if json_path:
        write_json(doc, json_path)
        print_note(f"wrote {json_path}")


def run_real_concurrency_cli(shape: str, levels_text: str, *, bits: int, workloads: Optional[str], prompt_tokens: int,
                             max_tokens: int, reps: int, seed: int, join_tokens: Optional[int],
                             json_path: Optional[str], progress) -> None:
    """``bench --real-shapes SHAPE --concurrency LIST``: bench/real_concurrency.py on one shape."""
    from ..bench.concurrency import parse_levels
    from ..bench.prompts import parse_list
    from ..bench.real_concurrency import render, run_real_concurrency
    from ..bench.real_shapes import parse_shapes
    from ..bench.report import real_concurrency_document, write_json

    shapes = parse_shapes(shape)
    if len(shapes) != 1:
        raise UsageError("--concurrency with --real-shapes runs one shape at a time (got "
                         f"{', '.join(shapes)})")
    levels = parse_levels(levels_text)
    chosen = parse_list(workloads, "workloads") or ["echo", "mtp-like"]

    def save(result):  # the repetitions done survive a run stopped later
        if json_path:
            write_json(real_concurrency_document(result), json_path)

    with progress("real shapes, requests at once") as on_step:
        result = run_real_concurrency(shapes[0], levels=levels, workloads=chosen, bits=bits,
                                      prompt_tokens=prompt_tokens, max_tokens=max_tokens, reps=reps, seed=seed,
                                      join_tokens=join_tokens, on_step=on_step, on_partial=save)
    save(result)
    render(result, stdout_console())
    if json_path:
        print_note(f"wrote {json_path}")
    if not all(c["identical"] for c in result["cells"]):
        print_note("note: some request's tokens differ from its script (column identical)")
