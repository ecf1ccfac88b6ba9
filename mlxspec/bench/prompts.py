"""``mlxspec bench``: mlx-lm against mlxspec's drafters on prompt sets, all in one process.

Engines run interleaved (for each repetition, each prompt, each engine) after one warm-up run
of each, on the same loaded target and the same prompt token ids, with the same EOS set and
max_tokens. Every generation is timed from the caller's side the same way: time to the first
token, then decode rate = tokens after the first / time from the first token to the last.
Time to first token is cold for every engine: mlx-lm prefills the whole prompt each time, so
mlxspec's engines do too (no prefix cache: nothing is reused from the warm-up or an earlier
repetition of the same prompt, which would compare a cache hit with a full prefill).
Per workload and engine the repetitions are aggregated (tokens over time across its prompts)
and the median over repetitions is reported; speedup is the ratio to mlx-lm's median.

A temperature-0 pass gives every metric and checks that each engine's tokens are identical to
mlx-lm's; an optional second pass at temperature > 0 (seeded per prompt) measures acceptance
and speed of the speculative engines under sampling.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..errors import MlxspecError, UsageError

ENGINES = ("mlx-lm", "mlx-lm-draft", "mlxspec-none", "mlxspec-pld", "mlxspec-draft",
           "mlxspec-mtp", "mlxspec-assistant", "mlxspec-dflash", "mlxspec-auto")
BASELINE = "mlx-lm"
# what each engine does, for --help and the JSON
ENGINE_HELP = {
    "mlx-lm": "mlx_lm.stream_generate, plain decoding (the baseline; always run)",
    "mlx-lm-draft": "mlx_lm.stream_generate with draft_model (dense targets only)",
    "mlxspec-none": "mlxspec, no drafter",
    "mlxspec-pld": "mlxspec, prompt lookup",
    "mlxspec-draft": "mlxspec, the --draft-model",
    "mlxspec-mtp": "mlxspec, the model's native MTP head",
    "mlxspec-assistant": "mlxspec, a Gemma-4 assistant given as --draft-model",
    "mlxspec-dflash": "mlxspec, a DFlash block drafter given as --draft-model (draft trees where they pay)",
    "mlxspec-auto": "mlxspec, drafter auto",
}
WORKLOAD_ORDER = ("echo", "completion", "novel", "toolcall")
SCHEMA = "mlxspec-bench/1"
WARMUP_TOKENS = 64
# how time to first token is measured, in the JSON's config and the table's caption
TTFT = "cold"
TTFT_NOTE = ("TTFT: cold for every engine (the whole prompt prefilled each time; mlxspec's prefix "
             "cache is not used, so no repetition reuses an earlier one's prefill)")
PROGRESS_EVERY_S = 0.1  # token counts go to on_step at most this often within a generation


class WorkloadError(MlxspecError):
    """A prompt set that cannot be read; the message names the file (and line)."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    max_tokens: int
    ids: list[int] = field(default_factory=list)  # the text's tokens, once a Bench encoded it (or given)
    meta: dict = field(default_factory=dict)  # what a built prompt was made of, for the JSON (fim: the span)


@dataclass(frozen=True)
class Workload:
    name: str
    path: Path
    prompts: list[Prompt]
    details: dict | None = None  # a built workload's own facts, for the JSON (fim: layout, budget)
    build: Callable | None = None  # build(spec) -> the Workload, once the model is loaded (fim)


# -- workloads --------------------------------------------------------------------------


def _read_workload(path: Path) -> list[Prompt]:
    prompts, seen = [], set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise WorkloadError(f"cannot read {path}: {err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise WorkloadError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(item, dict):
            raise WorkloadError(f"{where}: expected an object {{\"id\", \"prompt\", \"max_tokens\"}}")
        pid, text, max_tokens = item.get("id"), item.get("prompt"), item.get("max_tokens")
        if not isinstance(pid, str) or not pid:
            raise WorkloadError(f"{where}: \"id\" must be a non-empty string")
        if not isinstance(text, str) or not text:
            raise WorkloadError(f"{where}: \"prompt\" must be a non-empty string")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise WorkloadError(f"{where}: \"max_tokens\" must be a positive integer")
        if pid in seen:
            raise WorkloadError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        prompts.append(Prompt(pid, text, max_tokens))
    if not prompts:
        raise WorkloadError(f"{path} has no prompts")
    return prompts


def load_workloads(directory, names=None, prompts: int | None = None,
                   max_tokens: int | None = None) -> list[Workload]:
    """``DIR/NAME.jsonl`` for each name (default: every .jsonl there, the standard four first),
    first ``prompts`` lines of each, ``max_tokens`` overriding each line's."""
    folder = Path(directory)
    if not folder.is_dir():
        raise WorkloadError(f"workloads folder '{directory}' does not exist (set --workloads-dir)")
    found = sorted(p.stem for p in folder.glob("*.jsonl"))
    if names is None:
        names = [n for n in WORKLOAD_ORDER if n in found] + [n for n in found if n not in WORKLOAD_ORDER]
        if not names:
            raise WorkloadError(f"no workloads (*.jsonl) in '{directory}'")
    out = []
    for name in names:
        path = folder / f"{name}.jsonl"
        if not path.is_file():
            have = ", ".join(found) or "none"
            raise WorkloadError(f"no workload '{name}' in '{directory}' ({name}.jsonl; found: {have})")
        items = _read_workload(path)[:prompts] if prompts else _read_workload(path)
        if max_tokens:
            items = [replace(p, max_tokens=max_tokens) for p in items]
        out.append(Workload(name, path, items))
    return out


def parse_list(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--{what} is empty")
    return names


def parse_engines(text: str | None) -> list[str]:
    names = parse_list(text, "engines") or list(ENGINES)
    for name in names:
        if name not in ENGINES:
            raise UsageError(f"unknown engine '{name}'; choose from {', '.join(ENGINES)}")
    # the baseline always runs first: speedups and the identity check are against it
    return [BASELINE] + [e for e in ENGINES if e in names and e != BASELINE]


# -- one generation ---------------------------------------------------------------------


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float
    decode_s: float
    peak_mb: float
    active_mb: float
    finish: str | None = None
    drafter: str | None = None
    drafted: int | None = None
    accepted: int | None = None
    verify_steps: int | None = None
    from_draft: int | None = None  # tokens taken from drafts (mlxspec: accepted drafts)
    cached_tokens: int = 0  # prompt tokens restored from a prefix cache (cold TTFT: always 0)


class TokenCounter:
    """Tokens generated so far, passed to ``on_tokens(n)`` at the first token, then at most
    every PROGRESS_EVERY_S seconds, and once at the end (:meth:`done`): progress within a run
    without a callback per token in the timed loop."""

    def __init__(self, on_tokens=None):
        self.on_tokens = on_tokens
        self.count = 0
        self.next_at = 0.0

    def add(self, n: int, now: float) -> None:
        self.count += n
        if self.on_tokens is not None and n and now >= self.next_at:
            self.next_at = now + PROGRESS_EVERY_S
            self.on_tokens(self.count)

    def done(self) -> None:
        if self.on_tokens is not None:
            self.on_tokens(self.count)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@dataclass
class Options:
    reps: int = 3
    draft_depth: int = 3  # mlx-lm-draft's num_draft_tokens
    depth: int | None = None  # mlxspec engines: fixed depth (None: the engine chooses)
    temperature: float = 0.7  # the second pass
    temp_pass: bool = True
    seed: int = 0
    gates: bool = True  # mlxspec engines: speculation switched off where it does not pay


class Bench:
    """One loaded SpecModel, its workloads (prompts already tokenized) and engines."""

    def __init__(self, spec, workloads: list[Workload], engines: list[str], options: Options):
        self.spec, self.options = spec, options
        built = [w.build(spec) if w.build else w for w in workloads]
        self.workloads = [replace(w, prompts=[self._encoded(w, p) for p in w.prompts]) for w in built]
        self.skipped = {e: why for e in engines if (why := self.unavailable(e))}
        self.engines = [e for e in engines if e not in self.skipped]

    def _encoded(self, workload: Workload, prompt: Prompt) -> Prompt:
        """PROMPT with its text's token ids (the text as is, no chat template), unless given."""
        if prompt.ids:
            return prompt
        ids = self.spec.encode(prompt.text, raw=True)
        if not ids:
            raise WorkloadError(f"{workload.path}: prompt {prompt.id!r} encodes to no tokens")
        return replace(prompt, ids=ids)

    def unavailable(self, engine: str) -> str | None:
        """Why ``engine`` cannot run with this model (None: it can)."""
        spec = self.spec
        if engine in ("mlx-lm-draft", "mlxspec-draft", "mlxspec-assistant", "mlxspec-dflash") and spec.draft is None:
            return "needs --draft-model"
        from ..engine.drafters.registry import resolve_drafter

        kind = resolve_drafter("auto", spec.draft.model, None) if spec.draft is not None else None
        names = {"assistant": "a Gemma-4 assistant", "dflash": "a DFlash drafter"}
        if engine in ("mlx-lm-draft", "mlxspec-draft") and kind in names:
            return f"the --draft-model is {names[kind]}, not a model of its own (see mlxspec-{kind})"
        for drafter, what in names.items():
            if engine == f"mlxspec-{drafter}" and kind != drafter:
                return f"the --draft-model is not {what}"
        if engine == "mlx-lm-draft":
            from mlx_lm.models.cache import make_prompt_cache

            for which, loaded in (("the target", spec.target), ("the draft model", spec.draft)):
                kinds = sorted({type(c).__name__ for c in make_prompt_cache(loaded.model) if not c.is_trimmable()})
                if kinds:  # mlx-lm's own test (speculative_generate_step raises on these)
                    return (f"mlx-lm cannot speculate on {which}: its {', '.join(kinds)} layers "
                            "(recurrent / linear-attention state) cannot be trimmed back")
        if engine == "mlxspec-mtp":
            head, why_not = spec.mtp_head()
            if head is None:
                return why_not
        return None

    def generate(self, engine: str, ids: list[int], max_tokens: int, temperature: float,
                 on_tokens=None) -> Generation:
        """One generation of ENGINE, timed; ``on_tokens(n)``: the tokens so far (see TokenCounter)."""
        import mlx.core as mx

        mx.synchronize()
        mx.clear_cache()
        active = mx.get_active_memory()
        mx.reset_peak_memory()
        counter = TokenCounter(on_tokens)
        if engine.startswith("mlx-lm"):
            gen = self._mlx_lm(ids, max_tokens, temperature, engine == "mlx-lm-draft", counter)
        else:
            gen = self._mlxspec(engine.split("-", 1)[1], ids, max_tokens, temperature, counter)
        mx.synchronize()
        counter.done()
        return replace(gen, peak_mb=mx.get_peak_memory() / 1e6, active_mb=active / 1e6)

    def _mlx_lm(self, ids, max_tokens, temperature, with_draft, counter: TokenCounter) -> Generation:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        kwargs = dict(max_tokens=max_tokens, sampler=make_sampler(temp=temperature))
        if with_draft:
            kwargs.update(draft_model=self.spec.draft.model, num_draft_tokens=self.options.draft_depth)
        tokens, stamps, from_draft, finish = [], [], 0, None
        t0 = time.perf_counter()
        for r in stream_generate(self.spec.target.model, self.spec.tokenizer, ids, **kwargs):
            stamps.append(time.perf_counter())
            tokens.append(r.token)
            counter.add(1, stamps[-1])
            from_draft += r.from_draft
            finish = r.finish_reason
        return Generation(tokens, stamps[0] - t0, stamps[-1] - stamps[0], 0.0, 0.0, finish=finish,
                          from_draft=from_draft if with_draft else None)

    def _mlxspec(self, drafter, ids, max_tokens, temperature, counter: TokenCounter) -> Generation:
        from ..api import GenerationRequest

        # reuse=False: a cold prefill, as mlx-lm's (TTFT); the prompt cache would otherwise
        # hold this very prompt from the warm-up or the previous repetition
        request = GenerationRequest(max_tokens=max_tokens, temperature=temperature, drafter=drafter,
                                    depth=self.options.depth if drafter != "none" else None, raw=True,
                                    gates=self.options.gates, reuse=False)
        tokens, t_first, t_last, stats = [], None, None, None
        t0 = time.perf_counter()
        for chunk in self.spec.stream(ids, request=request):
            if chunk.tokens:
                t_last = time.perf_counter()
                t_first = t_first or t_last
                tokens.extend(chunk.tokens)
                counter.add(len(chunk.tokens), t_last)
            stats = chunk.stats
        return Generation(tokens, t_first - t0, t_last - t_first, 0.0, 0.0, finish=stats.finish_reason,
                          drafter=stats.drafter, drafted=stats.drafted, accepted=stats.accepted,
                          verify_steps=stats.verify_steps, from_draft=stats.accepted,
                          cached_tokens=stats.cached_tokens)

    # -- passes ------------------------------------------------------------------------
    def run(self, on_step=None, on_pass=None) -> dict:
        """Every pass; returns the JSON-ready result (without the environment). ``on_pass``
        gets the passes done so far after each one (to save partial results)."""
        passes = [self.run_pass(0.0, self.engines, on_step)]
        if self.options.temp_pass and self.options.temperature > 0:
            # the baseline (for speedups) and the engines that draft
            sampled = [e for e in self.engines if e != "mlxspec-none"]
            if len(sampled) > 1:
                if on_pass:
                    on_pass({"passes": passes})
                passes.append(self.run_pass(self.options.temperature, sampled, on_step))
        return {"passes": passes}

    def run_pass(self, temperature: float, engines: list[str], on_step=None) -> dict:
        import mlx.core as mx

        o = self.options
        seeded = temperature > 0
        first = self.workloads[0].prompts[0]
        for engine in engines:  # warm-up: kernels, allocator, the MTP head, the cost curve
            label, limit = f"warm-up {engine} (temperature {temperature:g})", min(first.max_tokens, WARMUP_TOKENS)
            if on_step:
                on_step(label, 0, 1)
            if seeded:
                mx.random.seed(o.seed)
            self.generate(engine, first.ids, limit, temperature, _tokens_step(on_step, label, limit, 0, 1))
        runs, first_rep = [], {}
        total = o.reps * sum(len(w.prompts) for w in self.workloads) * len(engines)
        for rep in range(o.reps):
            index = 0  # the prompt's position over all workloads: its seed offset
            for w in self.workloads:
                for p in w.prompts:
                    for engine in engines:
                        label = f"temperature {temperature:g}, rep {rep + 1}/{o.reps}: {w.name}/{p.id} {engine}"
                        if on_step:
                            on_step(label, len(runs), total)
                        if seeded:  # the same random stream for every engine on this prompt
                            mx.random.seed(o.seed + index)
                        g = self.generate(engine, p.ids, p.max_tokens, temperature,
                                          _tokens_step(on_step, label, p.max_tokens, len(runs), total))
                        # engines against mlx-lm's tokens; mlx-lm against its first repetition
                        if engine == BASELINE:
                            ref = g.tokens
                            diff = _first_diff(ref, first_rep.setdefault((w.name, p.id), ref))
                        else:
                            diff = _first_diff(g.tokens, ref)
                        diff = None if seeded else diff
                        runs.append(_run_record(rep, w, p, engine, g, None if seeded else diff is None, diff))
                    index += 1
        if on_step:
            on_step("done", total, total)
        return {"temperature": temperature, "seed": o.seed if seeded else None, "engines": engines,
                "runs": runs, "results": self.summarize(runs, engines, seeded)}

    def summarize(self, runs: list[dict], engines: list[str], seeded: bool) -> list[dict]:
        rows = []
        for w in self.workloads:
            base = None
            for engine in list(engines) + list(self.skipped):
                if engine in self.skipped:
                    rows.append({"workload": w.name, "engine": engine, "status": "skipped",
                                 "reason": self.skipped[engine]})
                    continue
                mine = [r for r in runs if r["workload"] == w.name and r["engine"] == engine]
                reps = [_aggregate([r for r in mine if r["rep"] == rep]) for rep in range(self.options.reps)]
                per_rep = {k: [r[k] for r in reps] for k in reps[0]}
                median = {k: _median(v) for k, v in per_rep.items()}
                if engine == BASELINE:
                    base = median["tps"]
                # mlx-lm: whether it gave the same tokens in every repetition
                identical = None if seeded else all(r["identical"] for r in mine)
                rows.append({"workload": w.name, "engine": engine, "status": "ok", "reps": per_rep,
                             "median": median, "identical": identical,
                             "speedup": median["tps"] / base if base and median["tps"] else None})
        return rows


def _tokens_step(on_step, label: str, max_tokens: int, done: int, total: int):
    """on_tokens(n) for one generation: LABEL with the tokens so far, to ON_STEP."""
    if on_step is None:
        return None
    return lambda n: on_step(f"{label}: {n}/{max_tokens} tokens", done, total)


def _run_record(rep, w, p, engine, g: Generation, identical, first_diff) -> dict:
    n = len(g.tokens)
    return {"rep": rep, "workload": w.name, "prompt": p.id, "engine": engine,
            "prompt_tokens": len(p.ids), "max_tokens": p.max_tokens, "generated": n,
            "ttft_s": round(g.ttft_s, 6), "decode_s": round(g.decode_s, 6),
            "tps": round((n - 1) / g.decode_s, 3) if n > 1 and g.decode_s > 0 else None,
            "peak_mb": round(g.peak_mb, 2), "active_mb": round(g.active_mb, 2), "finish": g.finish,
            "drafter": g.drafter, "drafted": g.drafted, "accepted": g.accepted,
            "verify_steps": g.verify_steps, "from_draft": g.from_draft, "cached_tokens": g.cached_tokens,
            "identical": identical, "first_diff": first_diff}


def _aggregate(runs: list[dict]) -> dict:
    """One repetition of one engine over a workload's prompts."""

    def total(key):
        return None if runs[0][key] is None else sum(r[key] for r in runs)

    generated, decode_s = total("generated"), total("decode_s")
    after_first = sum(max(r["generated"] - 1, 0) for r in runs)
    drafted, accepted, from_draft = total("drafted"), total("accepted"), total("from_draft")
    if drafted is not None:  # mlxspec: tokens committed per verify forward
        verifies = total("verify_steps")
        length = (accepted + verifies) / verifies if verifies else None
    elif from_draft is not None:  # mlx-lm-draft: each verify yields exactly one token of its own
        verifies = generated - from_draft
        length = generated / verifies if verifies else None
    else:
        length = None
    return {
        "tps": after_first / decode_s if decode_s > 0 else None,
        "ttft_ms": 1e3 * sum(r["ttft_s"] for r in runs) / len(runs),
        "peak_mb": max(r["peak_mb"] for r in runs),
        "generated": generated,
        "drafted": drafted,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": length,
        "draft_fraction": from_draft / generated if from_draft is not None and generated else None,
    }
