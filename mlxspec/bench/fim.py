"""The ``fim`` workload of ``mlxspec bench``: fill-in-the-middle on real code.

Each prompt is a span of 3-12 whole lines cut out of a function of mlxspec's own installed
source (the package's .py files, read through importlib.resources, so a wheel install has them
too), from a statement's first line to a statement's last, chosen by a seeded random generator:
the same package gives the same spans. The text
before the span is the prefix, the text after it the suffix, both trimmed at their far ends, by
whole lines, to BUDGET_TOKENS together; the prompt is the one ``POST /infill`` builds from them
(the model's own FIM layout, :func:`mlxspec.models.fim.prompt_ids`, with /infill's repository
lines and no other files), so prompt lookup drafts from the prefix and the suffix as it does
there. max_tokens is the span's length in tokens. A model without FIM tokens is a one-line error.
As in every workload, each engine stops at an end-of-text token or max_tokens (the server also
cuts the text at the layout's own tokens, a stop string applied after generation, the same for all).

Every engine gets the prompt's token ids, as in the other workloads; per prompt, the tables add
the span's tok/s, speedup over mlx-lm, acceptance and identity (:func:`per_prompt`).
"""

from __future__ import annotations

import ast
import functools
import random
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import UsageError
from ..models import fim
from ..models.tokens import plain_ids
from .prompts import BASELINE, Prompt, Workload, load_workloads

FIM = "fim"  # the workload's name: built here, not read from a .jsonl
DEFAULT_PROMPTS = 8
BUDGET_TOKENS = 1500  # prefix + suffix, at most
PREFIX_SHARE = 2 / 3  # of the budget, first offered to the prefix (editors send more before than after)
MIN_LINES, MAX_LINES = 3, 12
SPAN_SEED = 0
PACKAGE = "mlxspec"


@dataclass(frozen=True)
class Span:
    """Lines START..END (1-based, inclusive) of FILE, inside FUNCTION, and the text around them."""

    file: str
    start: int
    end: int
    function: str
    prefix: str
    middle: str
    suffix: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.start}-{self.end}"


# -- the spans ----------------------------------------------------------------------------


def package_sources(package: str = PACKAGE) -> list[tuple[str, str]]:
    """(path inside the package, text) of every .py file of the installed PACKAGE, sorted."""
    out: list[tuple[str, str]] = []

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            name = prefix + child.name
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, name + "/")
            elif child.name.endswith(".py"):
                try:
                    out.append((name, child.read_text(encoding="utf-8")))
                except (OSError, UnicodeDecodeError):
                    continue

    walk(resources.files(package), "")
    return sorted(out)


@dataclass(frozen=True)
class Body:
    """A function's body after its docstring: lines FIRST..LAST (1-based, inclusive), and the
    lines where its statements (nested ones included) begin and end."""

    name: str
    first: int
    last: int
    starts: tuple[int, ...]
    ends: frozenset[int]


@functools.lru_cache(maxsize=1024)  # the same package's files, parsed once per process
def function_bodies(text: str) -> tuple[Body, ...]:
    """Every function and method of TEXT (nested ones too); none where TEXT is not Python."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                body = body[1:]
            statements = [s for b in body for s in ast.walk(b) if isinstance(s, ast.stmt)]
            out.append(Body(node.name, body[0].lineno, node.end_lineno,
                            tuple(sorted({s.lineno for s in statements})), frozenset(s.end_lineno for s in statements)))
    return tuple(sorted(out, key=lambda f: (f.first, f.last, f.name)))


def _worth_filling(lines: list[str]) -> bool:
    """A span that holds some code: not blank lines or comments only."""
    return len([line for line in lines if line.strip() and not line.lstrip().startswith("#")]) >= 2


def pick_spans(sources: list[tuple[str, str]], count: int, seed: int = SPAN_SEED) -> list[Span]:
    """COUNT spans of MIN_LINES..MAX_LINES whole lines inside functions of SOURCES: each begins
    where a statement begins and ends where one ends, before its function's last line. Span i
    comes from a generator seeded with (SEED, i), so the first N spans are the same whatever COUNT."""
    regions = [(path, body) for path, text in sources for body in function_bodies(text)
               if body.last - body.first >= MIN_LINES]
    if not regions:
        raise UsageError("--workloads fim: no function long enough in the package's source")
    texts = dict(sources)
    spans: list[Span] = []
    taken: set[tuple[str, int]] = set()
    for i in range(count):
        rng = random.Random(f"mlxspec-fim:{seed}:{i}")
        for _ in range(500):
            path, body = rng.choice(regions)
            start = rng.choice(body.starts)
            ends = [e for e in range(start + MIN_LINES - 1, min(start + MAX_LINES, body.last)) if e in body.ends]
            if not ends or (path, start) in taken:
                continue
            end = rng.choice(ends)  # one line of the function at least after it
            lines = texts[path].splitlines(keepends=True)
            if not _worth_filling(lines[start - 1:end]):
                continue
            taken.add((path, start))
            spans.append(Span(path, start, end, body.name, "".join(lines[:start - 1]), "".join(lines[start - 1:end]),
                              "".join(lines[end:])))
            break
        else:
            raise UsageError(f"--workloads fim: found no span for prompt {i + 1} in the package's source")
    return spans


def trim(tokenizer, prefix: str, suffix: str, budget: int = BUDGET_TOKENS) -> tuple[str, str]:
    """PREFIX and SUFFIX cut at their far ends, by whole lines, to BUDGET tokens together: the
    lines next to the span are kept first, PREFIX_SHARE of the budget offered to the prefix."""
    before, after = prefix.splitlines(keepends=True), suffix.splitlines(keepends=True)

    def take(lines, used, limit):
        kept = 0
        for line in lines:
            cost = len(plain_ids(tokenizer, line))
            if used + cost > limit:
                break
            used, kept = used + cost, kept + 1
        return kept, used

    n_before, used = take(reversed(before), 0, int(budget * PREFIX_SHARE))
    n_after, used = take(after, used, budget)
    more, used = take(reversed(before[:len(before) - n_before]), used, budget)
    n_before += more
    while True:  # tokens of the joined text may differ from the sum over lines
        head = "".join(before[len(before) - n_before:])
        tail = "".join(after[:n_after])
        n_head, n_tail = len(plain_ids(tokenizer, head)), len(plain_ids(tokenizer, tail))
        if n_head + n_tail <= budget or not (n_before or n_after):
            return head, tail
        if n_head >= n_tail:
            n_before -= 1
        else:
            n_after -= 1


# -- the workload -------------------------------------------------------------------------


def layout_of(spec) -> fim.FimLayout:
    """SPEC's FIM layout; a UsageError (one line) where its vocabulary has no FIM tokens, or has
    them only past the model's embedding (as the server's /infill refuses them)."""
    found = fim.model_layout(spec.tokenizer, getattr(spec.target, "vocab_size", None))
    if found is None:
        raise UsageError(f"--workloads fim: {fim.NO_FIM_MESSAGE} ({spec.name}); give a code model with FIM "
                         "tokens (Qwen2.5/3-Coder, StarCoder2, Code Llama, DeepSeek-Coder)")
    return found


def build_prompts(spec, count: int, max_tokens: int | None = None, budget: int = BUDGET_TOKENS,
                  seed: int = SPAN_SEED, sources: list[tuple[str, str]] | None = None) -> list[Prompt]:
    """COUNT FIM prompts for SPEC (its tokens given as ids), max_tokens the span's tokens
    unless MAX_TOKENS; the prompt and its answer fit the model's context."""
    layout = layout_of(spec)
    tokenizer = spec.tokenizer
    limit = getattr(spec.target, "context_length", None)
    out = []
    for span in pick_spans(sources if sources is not None else package_sources(), count, seed):
        span_tokens = len(plain_ids(tokenizer, span.middle))
        answer = max_tokens or max(span_tokens, 1)
        room = budget if limit is None else min(budget, limit - answer - 32)  # 32: the layout's tokens
        if room < 16:
            raise UsageError(f"--workloads fim: {spec.name}'s context of {limit} tokens leaves no room "
                             f"for a prefix and suffix with {answer} tokens to generate")
        prefix, suffix = trim(tokenizer, span.prefix, span.suffix, room)
        ids = fim.prompt_ids(tokenizer, layout, prefix, suffix, extra=[])  # /infill's, no input_extra
        meta = {"file": span.file, "lines": [span.start, span.end], "function": span.function,
                "span_tokens": span_tokens, "prefix_tokens": len(plain_ids(tokenizer, prefix)),
                "suffix_tokens": len(plain_ids(tokenizer, suffix)), "middle": span.middle}
        out.append(Prompt(span.id, tokenizer.decode(ids), answer, ids=ids, meta=meta))
    return out


def fim_workload(prompts: int | None = None, max_tokens: int | None = None, budget: int = BUDGET_TOKENS,
                 seed: int = SPAN_SEED) -> Workload:
    """The ``fim`` workload: its prompts are built by ``build`` once the model is loaded."""
    count = prompts or DEFAULT_PROMPTS
    source = Path(str(resources.files(PACKAGE)))

    def build(spec) -> Workload:
        found = layout_of(spec)
        details = {"kind": FIM, "layout": found.family, "budget_tokens": budget, "span_seed": seed,
                   "lines": [MIN_LINES, MAX_LINES], "source": f"{PACKAGE} package source"}
        return Workload(FIM, source, build_prompts(spec, count, max_tokens, budget, seed), details=details)

    return Workload(FIM, source, [], build=build)


def load_sets(directory, names: list[str] | None, prompts: int | None = None,
              max_tokens: int | None = None) -> list[Workload]:
    """load_workloads, with ``fim`` among NAMES the FIM workload (built, not read from DIRECTORY;
    never a default: it needs a model with FIM tokens)."""
    if not names or FIM not in names:
        return load_workloads(directory, names, prompts, max_tokens)
    read = iter(load_workloads(directory, [n for n in names if n != FIM], prompts, max_tokens))
    return [fim_workload(prompts, max_tokens) if n == FIM else next(read) for n in names]


# -- per prompt ---------------------------------------------------------------------------


def per_prompt(result: dict, workload: str) -> list[dict]:
    """One pass's runs of WORKLOAD per prompt and engine: median tok/s over the repetitions,
    speedup over mlx-lm's median on the same prompt, acceptance (accepted / drafted over the
    repetitions), tokens generated and whether they were mlx-lm's at every repetition."""
    runs = [r for r in result["runs"] if r["workload"] == workload]
    rows = []
    for prompt in dict.fromkeys(r["prompt"] for r in runs):
        base = None
        for engine in result["engines"]:
            mine = [r for r in runs if r["prompt"] == prompt and r["engine"] == engine]
            if not mine:
                continue
            rates = [r["tps"] for r in mine if r["tps"] is not None]
            tps = statistics.median(rates) if rates else None
            if engine == BASELINE:
                base = tps
            drafted = sum(r["drafted"] or 0 for r in mine)
            accepted = sum(r["accepted"] or 0 for r in mine)
            same = [r["identical"] for r in mine]
            rows.append({"prompt": prompt, "engine": engine, "tps": tps,
                         "speedup": tps / base if base and tps else None,
                         "acceptance": accepted / drafted if drafted else None,
                         "generated": statistics.median(r["generated"] for r in mine),
                         "max_tokens": mine[0]["max_tokens"], "prompt_tokens": mine[0]["prompt_tokens"],
                         "identical": None if None in same else all(same)})
    return rows


def prompt_table(doc: dict, p: dict, workload: str):
    """The per-prompt table of one pass (a rich Table), from the JSON alone."""
    from rich.table import Table

    rows = p.get("per_prompt", {}).get(workload) or per_prompt(p, workload)
    spans = {q["id"]: q for q in doc.get("workloads", {}).get(workload, {}).get("prompts", [])}
    table = Table(title=f"{workload} per prompt (span: file:lines), temperature {p['temperature']:g}",
                  title_justify="left")
    for name in ("prompt", "engine", "prompt tok", "span tok", "tokens", "tok/s", "speedup", "accept",
                 "identical"):
        table.add_column(name, justify="left" if name in ("prompt", "engine") else "right", no_wrap=True)
    last = None
    for row in rows:
        same = "-" if row["identical"] is None else "yes" if row["identical"] else "NO"
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        table.add_row("" if row["prompt"] == last else row["prompt"], row["engine"],
                      str(row["prompt_tokens"]), str(spans.get(row["prompt"], {}).get("span_tokens", "-")),
                      f"{row['generated']:g}/{row['max_tokens']}",
                      "-" if row["tps"] is None else f"{row['tps']:.1f}", speedup,
                      "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}", same)
        last = row["prompt"]
    table.caption = ("speedup: tok/s over mlx-lm's on the same prompt (medians over the repetitions); "
                     "span tok: the cut span's tokens (max_tokens unless --max-tokens); tokens: generated / max")
    table.caption_justify = "left"
    return table


def with_per_prompt(doc: dict) -> dict:
    """DOC with, in each pass, the per-prompt rows (``per_prompt``) of its FIM workloads."""
    built = [name for name, w in doc.get("workloads", {}).items() if w.get("kind") == FIM]
    if not built:
        return doc
    passes = [{**p, "per_prompt": {w: per_prompt(p, w) for w in built}} for p in doc.get("passes", [])]
    return {**doc, "passes": passes}
