"""Measuring for ``mlxspec tune``: time the verify and draft steps with the engine's own
timing (:mod:`mlxspec.engine.costs`), count acceptance per draft position on the built-in
prompts, and pick each drafter's depth with the gates' formula
(:func:`~mlxspec.engine.gates.expected_speedup`). The record's layout is in the package doc."""

from __future__ import annotations

import datetime
import statistics
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

import mlx.core as mx

from ..engine.cache import ModelState
from ..engine.compiled_head import CompiledHead, head_forward
from ..engine.context_cost import measure_context_cost
from ..engine.costs import call_times, measure_verify_cost, verify_times
from ..engine.drafters.assistant import AssistantDrafter
from ..engine.drafters.dflash import DFlashDrafter
from ..engine.drafters.registry import resolve_drafter
from ..engine.gates import AcceptanceModel, CostModel, expected_speedup
from ..engine.sampling import SamplingParams
from ..engine.speculate import SpeculativeDecoder
from ..options import VERIFY_CONTEXT_BUDGET_S
from .prompts import PROMPTS
from .storage import CONTEXT_KEY, FORMAT_VERSION, machine_info, model_info, save_result

WIDTHS = tuple(range(1, 17))  # verify widths measured: every one of 1..16
TUNE_DEPTH = 8  # acceptance is measured drafting this many tokens per step
TUNE_CONTEXT_BUDGET_S = 4 * VERIFY_CONTEXT_BUDGET_S  # the verify cost over long contexts: more reps than a run's


# -- costs ---------------------------------------------------------------------------


def one_token_seconds(model, context: int, reps: int, vocab: int) -> float:
    """Median seconds of a 1-token forward over a warm cache of about ``context`` tokens."""
    times = verify_times(model, widths=(), context=context, reps=reps, vocab=vocab, warmup_each=True)
    return statistics.median(times[1])


def draft_model_cost(target, draft, vocab: int, context: int = 128, reps: int = 5) -> float:
    """One draft-model forward relative to one target forward (both 1 token, warm cache)."""
    t_target = one_token_seconds(target, context, reps, vocab)
    return one_token_seconds(draft, context, reps, vocab) / t_target


def mtp_cost(target, head, vocab: int, context: int = 128, reps: int = 5) -> float:
    """One MTP head step relative to one target forward (1 token, warm caches)."""
    state = ModelState(target, keep_hidden=True)
    tokens = [(7 * i) % vocab for i in range(context)]
    hidden = state.prefill(tokens)
    cache = head.make_cache()
    CompiledHead.prepare(cache)
    _, hid = head.step(mx.array(tokens[1:], mx.uint32), hidden[:-1], cache)
    mx.eval(hid)
    token = mx.array([5 % vocab], mx.uint32)
    last = hid[-1:]

    def drop_step():
        for c in cache:
            c.trim(1)

    # the step as the drafter runs it (compiled where that is on)
    steps = call_times(lambda: mx.eval(head_forward(head, token, last, cache, step=1)), reps, warmup=1,
                       after=drop_step)
    return statistics.median(steps) / one_token_seconds(target, context, reps, vocab)


def assistant_cost(target, assistant, vocab: int, context: int = 128, reps: int = 5) -> float:
    """One Gemma-4 assistant step relative to one target forward (over a warm target cache)."""
    state = ModelState(target, keep_hidden=True)
    tokens = [(7 * i) % vocab for i in range(context + 1)]
    drafter = AssistantDrafter(assistant, target)
    drafter.bind_target(state)
    drafter.start(tokens)
    drafter.prefill(tokens, context, state.prefill(tokens[:context]))
    step = drafter.stepper(context)
    token = mx.array([5 % vocab], mx.uint32)
    steps = call_times(lambda: mx.eval(step(1, token)), reps, warmup=1)
    return statistics.median(steps) / one_token_seconds(target, context, reps, vocab)


def draft_step_cost(spec, drafter: str, context: int, reps: int) -> float:
    """One draft step of ``drafter`` relative to one target forward (prompt lookup: free)."""
    vocab = spec.target.vocab_size
    if drafter == "pld":
        return 0.0
    if drafter == "draft":
        return draft_model_cost(spec.target.model, spec.draft.model, vocab, context, reps)
    if drafter == "assistant":
        return assistant_cost(spec.target.model, spec.draft.model, vocab, context, reps)
    if drafter == "dflash":
        return dflash_cost(spec.target.model, spec.draft.model, vocab, context, reps)
    return mtp_cost(spec.target.model, spec.mtp_head()[0], vocab, context, reps)


def dflash_cost(target, drafter_model, vocab: int, context: int = 128, reps: int = 5) -> float:
    """One DFlash block forward (any depth: the whole block runs) relative to one target
    forward, over a warm context."""
    drafter = DFlashDrafter(drafter_model, target)
    state = ModelState(target, keep_hidden=True, capture=drafter.capture_layers)
    tokens = [(7 * i) % vocab for i in range(context + 1)]
    drafter.start(tokens)
    drafter.prefill(tokens, context, state.prefill(tokens[:context]))
    state.close()
    k = drafter.block - 1
    steps = call_times(lambda: mx.eval(drafter.block_logits(tokens, k)), reps, warmup=1)
    return statistics.median(steps) / one_token_seconds(target, context, reps, vocab)


# -- acceptance and depth ------------------------------------------------------------


def measure_acceptance(spec, drafter: str, prompt: str, max_tokens: int, cost=None) -> dict:
    """Run the engine at fixed depth TUNE_DEPTH, gates off, greedy; per-position counts."""
    head = spec.mtp_head()[0] if drafter == "mtp" else None
    decoder = SpeculativeDecoder(
        spec.target.model, draft_model=spec.draft.model if spec.draft else None, mtp_head=head,
        drafter=drafter, depth=TUNE_DEPTH, gates=False, cost=cost, tree=0)  # chains: per-position counts
    ids = spec.encode(prompt)
    stats = None
    for _, stats in decoder.generate(ids, sampling=SamplingParams(), max_tokens=max_tokens,
                                     stop_tokens=set(spec.tokenizer.eos_token_ids)):
        pass
    drafted = list(stats.position_drafted) if stats else []
    accepted = list(stats.position_accepted) if stats else []
    drafted += [0] * (TUNE_DEPTH - len(drafted))
    accepted += [0] * (TUNE_DEPTH - len(accepted))
    return {"position_drafted": drafted[:TUNE_DEPTH], "position_accepted": accepted[:TUNE_DEPTH],
            "tokens": stats.generated_tokens if stats else 0,
            "ran": stats.drafter if stats else "none"}


def add_totals(rows: dict) -> dict:
    """Add the row ``all`` (the prompts' counts summed) to one drafter's acceptance rows, and
    to every row its acceptance rate per position; returns the ``all`` row."""
    drafted = [sum(r["position_drafted"][i] for r in rows.values()) for i in range(TUNE_DEPTH)]
    accepted = [sum(r["position_accepted"][i] for r in rows.values()) for i in range(TUNE_DEPTH)]
    rows["all"] = {"position_drafted": drafted, "position_accepted": accepted}
    for row in rows.values():
        row["rates"] = [round(a / d, 4) if d else None
                        for a, d in zip(row["position_accepted"], row["position_drafted"])]
    return rows["all"]


def depth_speedups(drafted, accepted, cost: CostModel | None, draft_cost: float,
                   max_depth: int = TUNE_DEPTH) -> dict[int, float]:
    """Expected speed relative to plain decoding at each depth 1..max_depth (the gate's formula)."""
    estimate = AcceptanceModel.from_counts(drafted, accepted, max_depth)
    cost = cost or CostModel.default()
    return {k: expected_speedup(estimate, k, cost, draft_cost) for k in range(1, max_depth + 1)}


def choose_depth(totals: dict, cost: CostModel, draft_cost: float) -> dict:
    """The depth with the best expected speed, from a drafter's summed counts."""
    drafted, accepted = totals["position_drafted"], totals["position_accepted"]
    if not any(drafted):  # nothing to go on: the engine keeps its own default
        return {"depth": None, "speedup": None, "speedups": {},
                "note": "no drafts were made on the tune prompts"}
    speedups = depth_speedups(drafted, accepted, cost, draft_cost)
    best = max(speedups, key=lambda k: speedups[k])
    return {"depth": best, "speedup": round(speedups[best], 4),
            "speedups": {str(k): round(s, 4) for k, s in speedups.items()}}


# -- a whole run ---------------------------------------------------------------------


def tunable_drafters(spec) -> list[str]:
    """The drafters that can run with this SpecModel (pld always; draft or assistant, mtp when
    available)."""
    drafters = ["pld"]
    if spec.draft is not None:
        drafters.append(resolve_drafter("auto", spec.draft.model, None))
    if spec.mtp_head()[0] is not None:
        drafters.append("mtp")
    return drafters


class StepCounter:
    """Numbers the steps of a run for ``on_step(message, steps done, total steps)``."""

    def __init__(self, on_step: Callable[[str, int, int], None] | None, total: int):
        self.on_step = on_step
        self.total = total
        self.done = 0

    def __call__(self, message: str) -> None:
        if self.on_step:
            self.on_step(message, self.done, self.total)
        self.done += 1


def run_tune(spec, *, max_tokens: int = 96, reps: int = 3, context: int = 128,
             on_step: Callable[[str, int, int], None] | None = None, save: bool = True) -> dict:
    """Measure, choose depths and (with ``save``) store the result; returns it (see the
    package doc), with ``path`` where it was stored."""
    drafters = tunable_drafters(spec)
    step = StepCounter(on_step, total=3 + len(drafters) * (1 + len(PROMPTS)))
    step("verify cost (1..16 tokens)")
    cost = measure_verify_cost(spec.target.model, widths=WIDTHS, context=context, reps=reps,
                               vocab=spec.target.vocab_size)
    step("verify cost over long contexts")
    measure_context_cost(spec.target.model, cost, context, vocab=spec.target.vocab_size,
                         budget_s=TUNE_CONTEXT_BUDGET_S)
    draft_cost: dict[str, float] = {}
    acceptance: dict[str, dict] = {}
    for name in drafters:
        step(f"{name}: draft cost")
        draft_cost[name] = round(draft_step_cost(spec, name, context, max(reps, 3)), 4)
        acceptance[name] = {}
        for kind, prompt in PROMPTS.items():
            step(f"{name}: acceptance on {kind}")
            acceptance[name][kind] = measure_acceptance(spec, name, prompt, max_tokens, cost)
            mx.clear_cache()

    step("choosing depths")
    depth = {name: choose_depth(add_totals(acceptance[name]), cost, draft_cost[name])
             for name in drafters}
    result = {
        "version": FORMAT_VERSION,
        "source": "tune",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(machine_info()),
        "model": model_info(spec.target),
        "draft_model": model_info(spec.draft) if spec.draft is not None else None,
        "mlx": package_version("mlx"),
        "tune_depth": TUNE_DEPTH,
        "max_tokens": max_tokens,
        "verify_cost": {str(n): round(cost.curve[n], 4) for n in sorted(cost.curve)},
        "plain_step": round(cost.plain, 4),
        CONTEXT_KEY: cost.context_record(),
        "draft_cost": draft_cost,
        "acceptance": acceptance,
        "depth": depth,
    }
    if save:
        result["path"] = str(save_result(spec.target, result))
    step("done")
    return result


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
