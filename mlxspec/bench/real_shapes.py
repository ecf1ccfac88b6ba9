"""``mlxspec bench --real-shapes``: the engines on random-weight models of real shapes, with
scripted outputs (:mod:`mlxspec.bench.script`), so speed is measured on the path users take
(bf16 activations, quantized weights, a KV cache growing token by token) and every output is
known in advance.

Per shape, all in one process: the target, a random MTP head of the real layout and a random
Qwen3-0.6B-shaped draft model are built (for a Gemma-4 target: its assistant, of the real
layout, instead of both: Gemma targets have no MTP head, and mlx-lm's draft loop cannot run an
assistant); the verify-cost curve the engine's depth choice uses
is measured as in ``run``; forwards of 1..N tokens over a growing cache are timed for the
ideal. Then, for each repetition, every (workload, engine, depth) cell generates once,
interleaved. Reported per cell, median over repetitions: tok/s, speedup over mlx-lm plain on
the same workload (per repetition, against that repetition's mlx-lm run), acceptance, tokens
per target forward, the ideal speedup (what the measured forward costs allow for the steps
this run took, with no host time) and achieved/ideal, and whether the tokens equal the script.

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

PROFILE_WORKLOADS = ("dflash", "mtp-like")  # script.PROFILES, named here without importing mlx

WORKLOADS = ("echo", "novel", "scripted-a0.8", "scripted-a0.6", "scripted-a1.0")
DEFAULT_SHAPES = ("qwen3-1.7b", "qwen3-8b", "qwen3.6-27b", "qwen3.6-35b-a3b")
DRAFT_SHAPE = "qwen3-0.6b"
ENGINES = ("mlx-lm", "mlx-lm-draft", "mlxspec-none", "mlxspec-pld", "mlxspec-mtp", "mlxspec-draft",
           "mlxspec-assistant", "mlxspec-dflash")
DFLASH_CHAINS = (3, 7, 15)  # forced chain depths: blocks of 4, 8 and 16
DFLASH_TREES = (4, 8, 16, 32)  # draft-tree node budgets
BASELINE = "mlx-lm"
MLX_LM_DRAFT_DEPTH = 3  # mlx-lm-draft's num_draft_tokens, as in `mlxspec bench`


@dataclass(frozen=True)
class Cell:
    workload: str
    engine: str
    depth: int | None = None  # None: the engine's own gates and depth choice; else forced, no gates
    temperature: float = 0.0
    tree: int | None = 0  # draft trees of at most this many nodes; 0: chains; None: the cost model picks

    @property
    def key(self) -> tuple:
        return (self.workload, self.engine, self.depth, self.temperature, self.tree)


def plan(workloads, dense: bool, depths, temperature: float | None, assistant: bool = False,
         dflash_block: int | None = None) -> list[Cell]:
    """The cells of one shape: each workload's engines, forced depths at full acceptance, and
    a seeded pass at ``temperature`` (None: none). ``assistant``: a Gemma-4 target, whose model
    drafter is its assistant (no MTP head, no separate draft model, no mlx-lm draft loop).
    ``dflash_block``: the block size of the shape's DFlash drafter (None: it has none)."""
    drafter = "mlxspec-assistant" if assistant else "mlxspec-mtp"
    cells = []
    for w in workloads:
        if w in PROFILE_WORKLOADS:
            cells += profile_cells(w, assistant, dflash_block)
            continue
        cells.append(Cell(w, BASELINE))
        if w in ("echo", "novel"):
            cells += [Cell(w, e) for e in ("mlxspec-none", "mlxspec-pld", drafter)]
        else:
            cells.append(Cell(w, drafter))
            if not assistant:
                cells.append(Cell(w, "mlxspec-draft"))
            if dense and not assistant:  # mlx-lm cannot roll back the hybrids' GatedDeltaNet caches
                cells.append(Cell(w, "mlx-lm-draft"))
            if w == "scripted-a1.0":
                cells += [Cell(w, e, d) for e in ("mlxspec-pld", drafter) for d in depths]
            elif w == "scripted-a0.8":  # the assistants are run up to block 8 elsewhere: every depth
                cells += [Cell(w, drafter, d) for d in depths if d <= 4 or assistant]
    if temperature:
        sampled = [("echo", "mlxspec-pld"), ("scripted-a0.8", drafter)]
        for w, e in sampled:
            if w in workloads:
                cells += [Cell(w, BASELINE, None, temperature), Cell(w, e, None, temperature)]
    return cells


def profile_cells(w: str, assistant: bool, block: int | None) -> list[Cell]:
    """A profile workload's cells: DFlash chains and trees (``dflash``), the MTP head (``mtp-like``)."""
    from .script import tree_depth

    if w == "dflash" and block:
        e = "mlxspec-dflash"
        return ([Cell(w, BASELINE), Cell(w, e), Cell(w, e, tree=None)]
                + [Cell(w, e, min(d, block - 1)) for d in DFLASH_CHAINS]
                + [Cell(w, e, tree_depth(w, n, block)[0], tree=n) for n in DFLASH_TREES])
    if w == "mtp-like" and not assistant:
        return [Cell(w, BASELINE), Cell(w, "mlxspec-mtp")]
    return []


def parse_shapes(text: str) -> list[str]:
    from .synthetic import SHAPES

    if text.strip() == "all":
        return list(DEFAULT_SHAPES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UsageError("--real-shapes needs at least one shape")
    for name in names:
        if name not in SHAPES:
            raise UsageError(f"unknown shape '{name}' for --real-shapes; choose from {', '.join(SHAPES)}")
    return names


# -- timing ---------------------------------------------------------------------------------


def forward_ms(model, widths, context: int, reps: int, vocab: int) -> dict[int, float]:
    """Median ms of a forward of n tokens (graph built, run and waited for) over a cache of
    ``context`` tokens that grows as in generation (the engine's own timing loop)."""
    from ..engine.costs import verify_times

    samples = verify_times(model, widths, context=context, reps=reps, vocab=vocab, warmup_each=True)
    return {n: 1e3 * statistics.median(times) for n, times in samples.items()}


def mtp_step_ms(head, context: int, reps: int) -> float:
    """Median ms of one MTP head draft step (its layer, the lm_head, a greedy pick)."""
    import mlx.core as mx

    from ..engine.costs import call_times

    cache = head.make_cache()
    hidden_size = head.module.fc.weight.shape[0]
    rows = mx.zeros((context, hidden_size), mx.bfloat16)
    mx.eval(head.forward(mx.arange(context).astype(mx.uint32), rows, cache))
    state = {"last": rows[-1:], "token": 0}  # each step feeds the previous step's hidden row

    def step():
        state["token"] += 1
        logits, state["last"] = head.step(mx.array([state["token"]], mx.uint32), state["last"], cache)
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
    from_draft: int | None = None  # mlx-lm-draft
    trees: list[tuple[int, int]] | None = None  # (nodes, depth) of each tree verified

    @property
    def tps(self) -> float | None:
        n = len(self.tokens)
        return (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else None


class ShapeBench:
    """One shape's models, scripts and measured costs; :meth:`run` generates one cell."""

    def __init__(self, shape: str, *, bits: int, prompt_tokens: int, max_tokens: int,
                 workloads, reps: int, seed: int = 0, widest: int = 9, on_step=None):
        from ..engine.cache import model_nbytes
        from ..engine.costs import measure_tree_factor, measure_verify_cost
        from .script import ScriptedLogits, make_script
        from .synthetic import MOE, dflash_step_ms, random_model, shape_config, tree_ms, vocab_size

        say = on_step or (lambda *a: None)
        self.shape, self.max_tokens, self.seed = shape, max_tokens, seed
        self.dense = shape_config(shape)["model_type"] == "qwen3"
        self.moe = shape in MOE
        vocab = vocab_size(shape)
        say(f"{shape}: building the target ({bits}-bit)")
        t0 = time.perf_counter()
        self.model = random_model(shape, bits=bits)
        self._build_drafters(shape, bits, vocab, workloads, say)
        self.build_s = time.perf_counter() - t0
        self.target_nbytes = model_nbytes(self.model)
        self.scripts = {w: make_script(w, vocab, prompt_tokens, max_tokens, seed) for w in workloads}
        self.target_logits = ScriptedLogits(self.model, [0])
        self.draft_logits = ScriptedLogits(self.draft, [0]) if self.draft is not None else None
        say(f"{shape}: measuring the verify-cost curve (as `run` does)")
        self.cost = measure_verify_cost(self.model, vocab=vocab)
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
        if any(w not in PROFILE_WORKLOADS for w in workloads):
            say(f"{shape}: building the draft model")
            draft_shape = DRAFT_SHAPE if shape.startswith("qwen") else "smoke"
            self.draft = random_model(draft_shape, vocab=vocab, bits=bits, seed=2)
        if "dflash" in workloads and shape in DFLASH:
            say(f"{shape}: building the DFlash drafter")
            self.dflash = random_dflash(self.model, shape, bits=bits)
            block = self.dflash.block_size
            self.trees = {n: profile_tree(PROFILES["dflash"], tree_depth("dflash", n, block)[0], n, vocab)
                          for n in DFLASH_TREES}

    def run(self, cell: Cell, max_tokens: int | None = None) -> Run:
        import mlx.core as mx

        script = self.scripts[cell.workload]
        self.target_logits.table = mx.array(script.target, mx.int32)
        if self.draft_logits is not None:
            self.draft_logits.table = mx.array(script.drafted, mx.int32)
        n = max_tokens or self.max_tokens
        seed = self.seed if cell.temperature > 0 else None
        mx.synchronize()
        mx.clear_cache()
        if cell.engine.startswith("mlx-lm"):
            return self._mlx_lm(script.prompt, n, cell, seed)
        return self._mlxspec(script, n, cell, seed)

    def _mlx_lm(self, prompt, n, cell: Cell, seed) -> Run:
        import mlx.core as mx
        from mlx_lm.generate import generate_step, speculative_generate_step
        from mlx_lm.sample_utils import make_sampler

        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp=cell.temperature)
        ids = mx.array(prompt, mx.uint32)
        if cell.engine == "mlx-lm-draft":
            steps = speculative_generate_step(ids, self.model, self.draft, sampler=sampler, max_tokens=n,
                                              num_draft_tokens=MLX_LM_DRAFT_DEPTH)
        else:
            steps = generate_step(ids, self.model, sampler=sampler, max_tokens=n)
        tokens, stamps, from_draft = [], [], 0
        for item in steps:
            tokens.append(int(item[0]))
            stamps.append(time.perf_counter())
            from_draft += bool(item[2]) if len(item) > 2 else 0
        return Run(tokens, stamps[-1] - stamps[0],
                   from_draft=from_draft if cell.engine == "mlx-lm-draft" else None)

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
        return "none"

    def _mlxspec(self, script, n, cell: Cell, seed) -> Run:
        from ..engine.sampling import SamplingParams
        from ..engine.speculate import SpeculativeDecoder

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
        return Run(tokens, stamps[-1] - stamps[0], stats=stats.to_dict(),
                   trees=None if trees is None else trees[: stats.tree_steps])

    def ideal(self, cell: Cell, run: Run, plain_ms: float) -> float | None:
        """The speedup this run's steps would give if each cost only its measured forward:
        plain steps at mlx-lm's per-token time, a verify of k drafts at a (k+1)-token forward
        plus k draft steps (a DFlash block: one step at any depth), a tree of N nodes at its
        measured tree verify (:meth:`_tree`) plus the block step."""
        n = len(run.tokens)
        if cell.engine == BASELINE or not n:
            return 1.0 if cell.engine == BASELINE else None
        if run.stats is None:  # mlx-lm-draft: every verify drafts MLX_LM_DRAFT_DEPTH
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
                    reps: int = 5, depths=tuple(range(1, 9)), workloads=WORKLOADS,
                    temperature: float | None = 0.7, seed: int = 0, on_step=None,
                    on_partial=None) -> dict:
    """Every cell of every shape; returns the JSON-ready result (without the environment).
    ``on_partial(result)`` gets the cells so far after each repetition (to save them)."""
    import mlx.core as mx

    from .script import parse_workload

    for w in workloads:
        parse_workload(w)
    if reps < 1 or prompt_tokens < 8 or max_tokens < 2:
        raise UsageError("--reps must be >= 1, --prompt-tokens >= 8 and --max-tokens >= 2")
    say = on_step or (lambda *a: None)
    cells_out, shapes_out = [], []
    config = {"shapes": list(shapes), "bits": bits, "prompt_tokens": prompt_tokens,
              "max_tokens": max_tokens, "reps": reps, "depths": list(depths),
              "workloads": list(workloads), "temperature": temperature, "seed": seed}
    for si, shape in enumerate(shapes):
        bench = ShapeBench(shape, bits=bits, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                           workloads=list(workloads), reps=reps, seed=seed,
                           widest=max(*depths, MLX_LM_DRAFT_DEPTH, 8, *(DFLASH_CHAINS * ("dflash" in workloads))) + 1,
                           on_step=lambda m: say(m, si, len(shapes)))
        cells = [c for c in plan(workloads, bench.dense, depths, temperature, assistant=bench.assistant is not None,
                                 dflash_block=bench.dflash.block_size if bench.dflash is not None else None)
                 if c.tree == 0 or bench.tree_error is None]  # trees that broke their timing would break runs
        for cell in cells:  # warm-up, whole runs: MLX's CUDA backend builds kernels per new
            # input shape (seconds each on an MoE shape); every shape a timed run meets is met here
            say(f"{shape}: warm-up {cell.workload} {cell.engine}", si, len(shapes))
            bench.run(cell)
        runs: dict[tuple, list[Run]] = {c.key: [] for c in cells}
        for rep in range(reps):
            for cell in cells:
                say(f"{shape}: rep {rep + 1}/{reps} {cell.workload} {cell.engine}"
                    + (f" depth {cell.depth}" if cell.depth else "") + (f" tree {cell.tree}" if cell.tree else ""),
                    si, len(shapes))
                runs[cell.key].append(bench.run(cell))
            if on_partial is not None:
                on_partial({"config": config, "shapes": shapes_out + [shape_info(bench, bits)],
                            "cells": cells_out + summarize(bench, cells, runs)})
        cells_out += summarize(bench, cells, runs)
        shapes_out.append(shape_info(bench, bits))
        del bench
        mx.clear_cache()
    say("done", len(shapes), len(shapes))
    return {"config": config, "shapes": shapes_out, "cells": cells_out}


def shape_info(bench: ShapeBench, bits: int) -> dict:
    """What one shape measured besides its cells (costs, drafters' steps, tree verifies)."""
    d = bench.dflash
    return {"shape": bench.shape, "bits": bits, "build_s": round(bench.build_s, 1),
            "weights_mb": round(bench.target_nbytes / 1e6, 1),
            "forward_ms": {str(k): round(v, 3) for k, v in bench.forward.items()},
            "draft_step_ms": {k: round(v, 3) for k, v in bench.draft_step_ms.items()},
            "cost_curve": {str(k): round(v, 3) for k, v in sorted(bench.cost.curve.items())},
            "tree_ms": {str(k): round(v, 3) for k, v in bench.tree_ms.items()},
            "tree_factor": bench.cost.tree_factor, "tree_error": bench.tree_error,
            "dflash": None if d is None else {"layers": d.args.num_hidden_layers, "block_size": d.block_size,
                                              "target_layer_ids": list(d.args.target_layer_ids)}}


def summarize(bench: ShapeBench, cells: list[Cell], runs: dict) -> list[dict]:
    out = []
    for cell in cells:
        mine = runs[cell.key]
        base = runs[Cell(cell.workload, BASELINE, None, cell.temperature).key]
        # a run of one token (or one step) has no decode time: no rate, no ratios
        timed = all(r.tps for r in mine + base)
        tps = statistics.median(r.tps for r in mine) if timed else None
        base_tps = statistics.median(r.tps for r in base) if timed else None
        ideals = [bench.ideal(cell, r, 1e3 / base_tps) for r in mine] if timed else [None]
        ideal = statistics.median(ideals) if None not in ideals else None
        want = bench.scripts[cell.workload].continuation[: bench.max_tokens]
        drafted = sum(r.stats["drafted"] for r in mine) if mine[0].stats else None
        accepted = sum(r.stats["accepted"] for r in mine) if mine[0].stats else None
        steps = [r.stats["verify_steps"] + r.stats["plain_steps"] if r.stats
                 else len(r.tokens) - (r.from_draft or 0) for r in mine]
        if cell.engine == "mlx-lm-draft":
            drafted = sum(MLX_LM_DRAFT_DEPTH * s for s in steps)
            accepted = sum(r.from_draft for r in mine)
        # Within a repetition the cells run back to back: the ratio to that repetition's
        # mlx-lm run cancels the slow drifts of a shared machine better than a ratio of medians.
        ratios = [r.tps / b.tps for r, b in zip(mine, base)] if timed else []
        speedup = statistics.median(ratios) if timed else None
        quart = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        trees = [t for r in mine for t in r.trees or ()]
        out.append({
            "shape": bench.shape, "workload": cell.workload, "engine": cell.engine,
            "depth": cell.depth if cell.depth is not None else "auto",
            "temperature": cell.temperature,
            "tree": "auto" if cell.tree is None else cell.tree,
            "tps": round(tps, 2) if timed else None, "speedup": round(speedup, 3) if timed else None,
            "speedup_iqr": [round(quart[0], 3), round(quart[2], 3)] if timed else None,
            "speedup_of_medians": round(tps / base_tps, 3) if timed else None,
            "ideal": round(ideal, 3) if ideal else None,
            "achieved_over_ideal": round(speedup / ideal, 3) if ideal else None,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_step": round(sum(len(r.tokens) for r in mine) / sum(steps), 3),
            "identical": all(r.tokens == want for r in mine),
            "reps_tps": [round(r.tps, 2) if r.tps else None for r in mine],
            "mean_depth": (round(statistics.mean(r.stats["mean_depth"] for r in mine), 2)
                           if mine[0].stats else None),
            "queued_used": sum(r.stats.get("queued_used", 0) for r in mine) if mine[0].stats else None,
            "tree_steps": len(trees) if mine[0].trees is not None else None,
            "mean_tree_nodes": round(statistics.mean(n for n, _ in trees), 2) if trees else None,
            "tree_note": mine[-1].stats.get("tree_note") if mine[0].stats else None,
            "gate_events": mine[-1].stats["gate_events"] if mine[0].stats else None,
        })
    return out
