"""``mlxspec bench --real-shapes``: the engines on random-weight models of real shapes, with
scripted outputs (:mod:`mlxspec.bench.script`), so speed is measured on the path users take
(bf16 activations, quantized weights, a KV cache growing token by token) and every output is
known in advance.

Per shape: the target, a random MTP head of the real layout and a random Qwen3-0.6B-shaped draft
model are built (for a Gemma-4 target: its assistant, of the real layout, instead of both: Gemma
targets have no MTP head, and mlx-lm's draft loop cannot run an assistant); the verify-cost curve
the engine's depth choice uses is measured as in ``run``; forwards of 1..N tokens over a growing
cache are timed for the ideal. The baseline is stock mlx-lm: a second process
(:mod:`.stock_worker`, started by :class:`.stock.StockBaseline`) builds the same shape with no
mlxspec kernel anywhere in it, proves it (:mod:`.stock_evidence`, checked before the first run
and after the last, written in the JSON) and runs mlx-lm's ``generate_step`` (and its draft loop)
on command. Then ``reps`` repetitions (8 by default), each every cell once, ABAB: each cell's
run right after a stock mlx-lm run of the same workload (:mod:`.real_summary`). Reported per
cell: the median and interquartile range of the paired ratios (tok/s over the adjacent
baseline's), the ideal speedup (what the measured forward costs allow for the steps this run
took, with no host time, against the baseline's measured per-token time) and achieved/ideal,
acceptance, tokens per target forward, and whether the tokens equal the script.

Profile workloads (``dflash``, ``mtp-like``: :data:`script.PROFILES`): a DFlash drafter of the
published size (``synthetic.DFLASH``), steered after its real block forward, as chains of depth
3 / 7 / 15 and gated, as trees of 4 / 8 / 16 / 32 nodes (each at the depth whose tree keeps the
most; its tree verify timed for the ideal) and of the cost model's size; the gated MTP head.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ..errors import UsageError
from .real_plan import (  # noqa: F401 - the plan's names, importable from here as before
    BASELINE,
    DEFAULT_SHAPES,
    DFLASH_CHAINS,
    DFLASH_TREES,
    DRAFT_SHAPE,
    ENGINES,
    MLX_LM_DRAFT_DEPTH,
    PROFILE_WORKLOADS,
    STOCK_DRAFT,
    STOCK_ENGINES,
    WITH_KERNELS,
    WORKLOADS,
    Cell,
    parse_shapes,
    plan,
    profile_cells,
)
from .real_summary import measure, shape_info, summarize

# -- timing ---------------------------------------------------------------------------------


def run_costs(model, vocab: int, horizon: int, say):
    """The verify costs `run` measures for a request that may reach HORIZON tokens: the curve,
    and how it grows with the context where HORIZON reaches CONTEXT_COST_FROM (within `run`'s
    budget for that); each step announced to SAY."""
    from ..engine.context_cost import measure_context_cost
    from ..engine.costs import measure_verify_cost
    from ..options import CONTEXT_COST_FROM, VERIFY_CONTEXT_BUDGET_S

    say("measuring the verify-cost curve (as `run` does)")
    cost = measure_verify_cost(model, vocab=vocab)
    if horizon >= CONTEXT_COST_FROM:
        say("measuring how the verify cost grows with the context (as `run` does)")
        measure_context_cost(model, cost, cost.context, vocab=vocab, budget_s=VERIFY_CONTEXT_BUDGET_S)
    return cost


def forward_ms(model, widths, context: int, reps: int, vocab: int) -> dict[int, float]:
    """Median ms of a forward of n tokens (graph built, run and waited for) over a cache of
    ``context`` tokens that grows as in generation (the engine's own timing loop)."""
    from ..engine.costs import verify_times

    samples = verify_times(model, widths, context=context, reps=reps, vocab=vocab, warmup_each=True)
    return {n: 1e3 * statistics.median(times) for n, times in samples.items()}


def mtp_step_ms(head, context: int, reps: int) -> float:
    """Median ms of one MTP head draft step (its layer, the lm_head, a greedy pick), as the
    drafter runs it: compiled with ``MLXSPEC_COMPILED_HEAD=1`` (``engine/compiled_head.py``)."""
    import mlx.core as mx

    from ..engine.compiled_head import CompiledHead, head_forward
    from ..engine.costs import call_times

    cache = head.make_cache()
    CompiledHead.prepare(cache)
    hidden_size = head.module.fc.weight.shape[0]
    rows = mx.zeros((context, hidden_size), mx.bfloat16)
    mx.eval(head.forward(mx.arange(context).astype(mx.uint32), rows, cache))
    state = {"last": rows[-1:], "token": 0}  # each step feeds the previous step's hidden row

    def step():  # as the drafter runs it (compiled where that is on)
        state["token"] += 1
        state["last"], logits = head_forward(head, mx.array([state["token"]], mx.uint32), state["last"], cache)
        mx.eval(mx.argmax(logits, axis=-1), state["last"])

    # one untimed step first: the first call compiles kernels for the new shape
    return 1e3 * statistics.median(call_times(step, reps, warmup=1))


def assistant_step_ms(model, assistant, context: int, reps: int) -> float:
    """Median ms of one Gemma-4 assistant draft step (its layers over the target's cache of
    ``context`` tokens, its LM head, a greedy pick), through the drafter's own step."""
    import mlx.core as mx

    from ..engine.cache import ModelState
    from ..engine.costs import call_times
    from ..engine.drafters.assistant import AssistantDrafter

    state = ModelState(model, keep_hidden=True)
    rows = state.prefill([i % assistant.vocab_size for i in range(context)])
    drafter = AssistantDrafter(assistant, model)
    drafter.bind_target(state)
    drafter.add_hidden(rows)
    step = drafter.stepper(context - 1)  # each step chains on the hidden row of the one before
    token = {"id": 0}

    def one():
        token["id"] += 1
        mx.eval(mx.argmax(step(token["id"], mx.array([token["id"]], mx.uint32)), axis=-1))

    return 1e3 * statistics.median(call_times(one, reps, warmup=1))


# -- one generation -------------------------------------------------------------------------


@dataclass
class Run:
    tokens: list[int]
    decode_s: float
    stats: dict | None = None  # mlxspec's Stats.to_dict()
    from_draft: int | None = None  # the stock draft loop's tokens from the draft model
    trees: list[tuple[int, int]] | None = None  # (nodes, depth) of each tree verified

    @property
    def tps(self) -> float | None:
        n = len(self.tokens)
        return (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else None


class ShapeBench:
    """One shape's models, scripts and measured costs; :meth:`run` generates one cell."""

    def __init__(self, shape: str, *, bits: int, prompt_tokens: int, max_tokens: int,
                 workloads, reps: int, seed: int = 0, widest: int = 9, on_step=None, stock: bool = True):
        from ..engine.cache import model_nbytes
        from ..engine.costs import measure_tree_factor
        from .script import ScriptedLogits, make_script
        from .stock import StockBaseline, build_beside
        from .synthetic import MOE, dflash_step_ms, random_model, shape_config, tree_ms, vocab_size

        say = on_step or (lambda *a: None)
        self.shape, self.max_tokens, self.seed = shape, max_tokens, seed
        self.dense = shape_config(shape)["model_type"] == "qwen3"
        self.moe = shape in MOE
        vocab = vocab_size(shape)
        say(f"{shape}: building the target ({bits}-bit)")
        t0 = time.perf_counter()
        # the stock mlx-lm process builds its own copy meanwhile (``stock``: tests of the rest may skip it)
        # (its draft model only where mlx-lm's draft loop runs: dense targets)
        self.stock = StockBaseline(shape, bits=bits, vocab=vocab, wait=False,
                                   draft_shape=self._draft_shape(shape, workloads) if self.dense else None
                                   ) if stock else None

        def build():
            self.model = random_model(shape, bits=bits)
            self._build_drafters(shape, bits, vocab, workloads, say)

        build_beside(self.stock, build, say, shape)
        self.stock_evidence = self.stock.evidence if self.stock is not None else None
        self.build_s = time.perf_counter() - t0
        self.target_nbytes = model_nbytes(self.model)
        self.scripts = {w: make_script(w, vocab, prompt_tokens, max_tokens, seed) for w in workloads}
        self.target_logits = ScriptedLogits(self.model, [0])
        self._scripted = None  # the script whose tables the scripted logits hold
        self.draft_logits = ScriptedLogits(self.draft, [0]) if self.draft is not None else None
        self.cost = run_costs(self.model, vocab, prompt_tokens + max_tokens, lambda what: say(f"{shape}: {what}"))
        say(f"{shape}: timing forwards over a growing cache")
        self.forward = forward_ms(self.model, range(2, widest + 1), prompt_tokens, reps, vocab)
        self.draft_step_ms = {"mlxspec-pld": 0.0}
        if self.assistant is not None:
            self.draft_step_ms["mlxspec-assistant"] = assistant_step_ms(self.model, self.assistant, prompt_tokens, reps)
        if self.head is not None:
            self.draft_step_ms["mlxspec-mtp"] = mtp_step_ms(self.head, prompt_tokens, reps)
        if self.draft is not None:
            self.draft_step_ms["mlxspec-draft"] = forward_ms(self.draft, (), prompt_tokens, reps, vocab)[1]
        self.tree_ms: dict[int, float] = {}
        self.tree_error = None
        if self.dflash is not None:
            say(f"{shape}: timing the DFlash block step and the tree verifies")
            self.draft_step_ms["mlxspec-dflash"] = dflash_step_ms(self.dflash, self.model, prompt_tokens, reps)
            try:  # (a target that cannot verify trees gets {} and None: its cells verify chains)
                self.tree_ms = tree_ms(self.model, self.trees, prompt_tokens, reps, vocab)
                self.cost.tree_factor = measure_tree_factor(self.model, vocab=vocab)  # as `run` does for dflash
            except Exception as err:  # noqa: BLE001 - a tree verify that fails: the tree cells are left out
                self.tree_error = f"{type(err).__name__}: {err}"

    @staticmethod
    def _draft_shape(shape: str, workloads) -> str | None:
        """The draft model's shape where :meth:`_build_drafters` builds one (else None)."""
        from .gemma4_shapes import GEMMA4

        if shape in GEMMA4 or all(w in PROFILE_WORKLOADS for w in workloads):
            return None
        return DRAFT_SHAPE if shape.startswith("qwen") else "smoke"

    def close(self) -> None:
        """Stop the stock mlx-lm process (its evidence checked once more first: ``stock_evidence``)."""
        if self.stock is not None:
            stock, self.stock = self.stock, None
            self.stock_evidence = stock.finish()

    def _build_drafters(self, shape: str, bits: int, vocab: int, workloads, say) -> None:
        """The assistant (Gemma-4), else the MTP head, the draft model (when a workload runs it)
        and the DFlash drafter (when ``dflash`` is a workload and the shape has one)."""
        from .gemma4_shapes import GEMMA4, assistant_config
        from .script import PROFILES, profile_tree, tree_depth
        from .synthetic import DFLASH, random_assistant, random_dflash, random_model, random_mtp_head

        self.head = self.draft = self.assistant = self.dflash = None
        self.trees = {}
        if shape in GEMMA4:
            say(f"{shape}: building the assistant")
            self.assistant = random_assistant(self.model, assistant_config(shape), bits=bits)
            return
        say(f"{shape}: building the MTP head")
        self.head = random_mtp_head(self.model, shape, bits=bits)
        draft_shape = self._draft_shape(shape, workloads)
        if draft_shape is not None:
            say(f"{shape}: building the draft model")
            self.draft = random_model(draft_shape, vocab=vocab, bits=bits, seed=2)
        if "dflash" in workloads and shape in DFLASH:
            say(f"{shape}: building the DFlash drafter")
            self.dflash = random_dflash(self.model, shape, bits=bits)
            block = self.dflash.block_size
            self.trees = {n: profile_tree(PROFILES["dflash"], tree_depth("dflash", n, block)[0], n, vocab)
                          for n in DFLASH_TREES}

    def run(self, cell: Cell, max_tokens: int | None = None) -> Run:
        import mlx.core as mx

        from ..engine.compiled_forward import CompiledForward

        script = self.scripts[cell.workload]
        if self._scripted is not script:
            self.target_logits.table = mx.array(script.target, mx.int32)
            if self.draft_logits is not None:
                self.draft_logits.table = mx.array(script.drafted, mx.int32)
            # a compiled verify holds the table it was traced with: each script its own graphs
            # (forgetting them at each switch traced them again inside every timed repetition)
            for model in (self.model, self.draft):
                if model is not None:
                    CompiledForward.of(model).scope = cell.workload
            self._scripted = script
        n = max_tokens or self.max_tokens
        seed = self.seed if cell.temperature > 0 else None
        if cell.engine in STOCK_ENGINES:
            if self.stock is None:
                raise UsageError(f"{cell.engine} needs the stock mlx-lm process (ShapeBench(stock=True))")
            depth = MLX_LM_DRAFT_DEPTH if cell.engine == STOCK_DRAFT else None
            out = self.stock.run(script.prompt, script.target, script.drafted, n, cell.temperature, seed, depth)
            return Run(out["tokens"], out["decode_s"], from_draft=out["from_draft"] if depth else None)
        mx.synchronize()
        mx.clear_cache()
        if cell.engine == WITH_KERNELS:
            from .stock_worker import generate

            out = generate(self.model, None, script.prompt, n, cell.temperature, seed, None)
            return Run(out["tokens"], out["decode_s"])
        return self._mlxspec(script, n, cell, seed)

    def _drafter(self, engine: str, script):
        from ..engine.drafters.assistant import AssistantDrafter
        from ..engine.drafters.draft_model import DraftModelDrafter
        from ..engine.drafters.mtp import MTPDrafter
        from ..engine.drafters.pld import PromptLookupDrafter
        from .script import SteeredAssistant, SteeredDFlash, SteeredLookup, SteeredMTP

        steered = script.steered
        # a draft step's measured cost, as `run` measures it on a machine with no tune record
        cost = self.draft_step_ms.get(engine, 0.0) / self.forward[1]
        if engine == "mlxspec-pld":
            return SteeredLookup(script) if steered else PromptLookupDrafter()
        if engine == "mlxspec-mtp":
            if steered:
                return SteeredMTP(self.head, self.target_nbytes, script, cost_per_token=cost)
            return MTPDrafter(self.head, self.target_nbytes, cost_per_token=cost)
        if engine == "mlxspec-draft":
            return DraftModelDrafter(self.draft, self.target_nbytes, cost)  # steered by its logits
        if engine == "mlxspec-assistant":
            if steered:
                return SteeredAssistant(self.assistant, self.model, script, self.target_nbytes, cost)
            return AssistantDrafter(self.assistant, self.model, self.target_nbytes, cost)
        if engine == "mlxspec-dflash":  # a block step's cost whatever its depth
            return SteeredDFlash(self.dflash, self.model, script, self.target_nbytes, cost)
        if engine == "mlxspec-none":
            return "none"
        raise UsageError(f"unknown real-shapes engine '{engine}' ({', '.join(ENGINES)})")

    def _mlxspec(self, script, n, cell: Cell, seed) -> Run:
        from ..engine.compiled_forward import traces
        from ..engine.sampling import SamplingParams
        from ..engine.speculate import SpeculativeDecoder

        traced = traces()[0]
        forced = cell.depth is not None
        drafter = self._drafter(cell.engine, script)
        dec = SpeculativeDecoder(self.model, drafter=drafter, depth=cell.depth, gates=not forced, cost=self.cost,
                                 tree=cell.tree)
        tokens, stamps, stats = [], [], None
        for new, stats in dec.generate(script.prompt, sampling=SamplingParams(cell.temperature),
                                       max_tokens=n, seed=seed):
            if new:
                tokens.extend(new)
                stamps.append(time.perf_counter())
        trees = getattr(drafter, "tree_log", None)  # a tree the target could not verify is not counted
        return Run(tokens, stamps[-1] - stamps[0], stats=stats.to_dict() | {"compiled_traces": traces()[0] - traced},
                   trees=None if trees is None else trees[: stats.tree_steps])

    def ideal(self, cell: Cell, run: Run, plain_ms: float) -> float | None:
        """The speedup this run's steps would give over stock mlx-lm if each cost only its
        measured forward (no host time, no launch gaps): ``plain_ms`` is stock mlx-lm's measured
        pipelined per-token time (the summary passes the paired baseline run's, 1000 / its tok/s);
        a plain step costs that, a verify of k drafts a (k+1)-token forward (:attr:`forward`,
        timed over a cache growing from the prompt) plus k draft steps (:attr:`draft_step_ms`; a
        DFlash block: one step at any depth), a tree of N nodes its measured tree verify
        (:meth:`_tree`) plus the block step. The steps are the run's own (its depth histogram),
        so acceptance is the measured one. mlx-lm's plain engines: 1."""
        n = len(run.tokens)
        if cell.engine in (BASELINE, WITH_KERNELS) or not n:
            return 1.0 if cell.engine in (BASELINE, WITH_KERNELS) else None
        if run.stats is None:  # the stock draft loop: every verify drafts MLX_LM_DRAFT_DEPTH
            k = MLX_LM_DRAFT_DEPTH
            verifies = n - (run.from_draft or 0)
            step = self._forward(k + 1) + k * self.draft_step_ms["mlxspec-draft"]
            return n * plain_ms / (verifies * step)
        s = run.stats
        draft = self.draft_step_ms.get(cell.engine, 0.0)
        steps = {int(k): count for k, count in s["depth_histogram"].items()}
        total = s["plain_steps"] * plain_ms
        for nodes, depth in run.trees or ():  # the histogram counts a tree at its depth
            steps[depth] -= 1
            total += self._tree(nodes) + draft
        for k, count in steps.items():
            total += count * (self._forward(k + 1) + (draft if cell.engine == "mlxspec-dflash" else k * draft))
        return n * plain_ms / total if total else None

    def _tree(self, nodes: int) -> float:
        """Measured ms of a tree verify of NODES nodes: timed for the tree cells' sizes,
        interpolated (or extended along the last two) between them; a chain verify of as many
        rows where none was timed."""
        t = self.tree_ms
        if nodes in t or len(t) < 2:
            return t.get(nodes) or self._forward(nodes + 1)
        sizes = sorted(t)
        lo = max([m for m in sizes if m < nodes] or sizes[:1])
        hi = min([m for m in sizes if m > nodes and m != lo] or sizes[-1:])
        if hi == lo:
            lo = sizes[-2]
        return t[lo] + (t[hi] - t[lo]) * (nodes - lo) / (hi - lo)

    def _forward(self, n: int) -> float:
        return self.forward.get(n) or self.forward[max(self.forward)] * n / max(self.forward)


# -- the whole benchmark --------------------------------------------------------------------


def run_real_shapes(shapes, *, bits: int = 4, prompt_tokens: int = 512, max_tokens: int = 128,
                    reps: int = 8, depths=tuple(range(1, 9)), workloads=WORKLOADS,
                    temperature: float | None = 0.7, seed: int = 0, on_step=None,
                    on_partial=None, engines: frozenset[str] | None = None) -> dict:
    """Every cell of every shape, ``reps`` ABAB repetitions against stock mlx-lm
    (:func:`.real_summary.measure`); returns the JSON-ready result (without the environment):
    ``baseline`` names it, each shape carries its process's evidence. ``on_partial(result)``
    gets the cells so far after each repetition (to save them). ``engines``: only these engines'
    cells (:func:`.real_plan.parse_engines`; None: all)."""
    import mlx.core as mx

    from .script import parse_workload

    for w in workloads:
        parse_workload(w)
    if reps < 1 or prompt_tokens < 8 or max_tokens < 2:
        raise UsageError("--reps must be >= 1, --prompt-tokens >= 8 and --max-tokens >= 2")
    say = on_step or (lambda *a: None)
    cells_out, shapes_out = [], []
    config = {"shapes": list(shapes), "bits": bits, "prompt_tokens": prompt_tokens,
              "max_tokens": max_tokens, "reps": reps, "order": "ABAB", "depths": list(depths),
              "workloads": list(workloads), "temperature": temperature, "seed": seed,
              "engines": sorted(engines) if engines is not None else "all"}
    result = lambda cells, infos: {"baseline": BASELINE, "config": config, "shapes": infos, "cells": cells}  # noqa: E731
    for si, shape in enumerate(shapes):
        bench = ShapeBench(shape, bits=bits, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                           workloads=list(workloads), reps=reps, seed=seed,
                           widest=max(*depths, MLX_LM_DRAFT_DEPTH, 8, *(DFLASH_CHAINS * ("dflash" in workloads))) + 1,
                           on_step=lambda m: say(m, si, len(shapes)))
        try:
            cells = [c for c in plan(workloads, bench.dense, depths, temperature, assistant=bench.assistant is not None,
                                     dflash_block=bench.dflash.block_size if bench.dflash is not None else None)
                     if (c.tree == 0 or bench.tree_error is None)  # trees that broke their timing would break runs
                     and (engines is None or c.engine in engines)]
            for cell in cells:  # warm-up, whole runs: MLX's CUDA backend builds kernels per new
                # input shape (seconds each on an MoE shape); every shape a timed run meets is met here
                say(f"{shape}: warm-up {cell.workload} {cell.engine}", si, len(shapes))
                bench.run(cell)

            def partial(rep, runs, pairs):
                if on_partial is not None:
                    on_partial(result(cells_out + summarize(bench, cells, runs, pairs),
                                      shapes_out + [shape_info(bench, bits)]))

            runs, pairs = measure(bench, cells, reps, lambda m: say(f"{shape}: {m}", si, len(shapes)), partial)
        finally:
            bench.close()  # the stock process's evidence, checked once more, then it stops
        cells_out += summarize(bench, cells, runs, pairs)
        shapes_out.append(shape_info(bench, bits))
        bench = None  # the models go before the next shape's are built
        mx.clear_cache()
    say("done", len(shapes), len(shapes))
    return result(cells_out, shapes_out)
