"""``mlxspec bench --real-shapes SHAPES --sharded``: speculation on a target sharded over the
processes of an ``mlx.launch`` run, against stock mlx-lm's plain decoding of the same sharded
target in the same processes; started without ``mlx.launch``, the same on one device (the
scaling reference).

Every rank builds the same random model of the shape (same seed, :func:`.synthetic.random_model`),
shards it with its family's ``shard(group)`` (mlx-lm's tensor parallelism, as ``sharded_load``
does) and scripts its logits (:class:`.scripted.ScriptedLogits`; a head split over the
vocabulary scripts its own slice). mlxspec's engines run with mlxspec's CUDA kernels on the
shard, as a sharded ``run`` loads it (``models.loader``); the one-device reference the same.

The baseline, :data:`.real_plan.BASELINE`, is mlx-lm's ``generate_step`` on that model, in this process
(a second process could not join the ranks' collectives). Before each baseline run the kernels
are taken out (:func:`mlxspec.kernels.uninstall`: mlx-lm's functions rebound, mlx's layer
classes back) and the layers mlxspec's engine gave a class of its own (the GatedDeltaNet tape)
get mlx-lm's class back; before each mlxspec run the kernels go in again.
:func:`.stock_evidence.evidence` checks before the first baseline run and after the last that
mlx-lm's functions are its own, nothing of mlxspec's is bound into mlx / mlx-lm and the model's
layers are mlx-lm's (the scripting aside). It lists the kernel modules imported; none of them
is installed while the baseline runs.

Engines, decided as an unseeded ``mlxspec run`` decides under ``mlx.launch``: on costs every
rank measures together and takes from rank 0 (the verify curve, the pipelined plain token, each
MTP head's step: :mod:`mlxspec.tuning.shared`), the committed tokens compared across ranks
after every step (:func:`mlxspec.engine.ranks.checked`). Cells: ``echo`` (mlxspec plain and prompt
lookup) and ``mtp-like`` (the MTP head steered to the profile), each run right after a baseline
run (ABAB, :func:`.real_summary.measure`), ``reps`` repetitions.
"""

from __future__ import annotations

import os
import time

from ..errors import UsageError
from .real_plan import BASELINE, Cell
from .real_shapes import Run, forward_ms

WHERE_BASELINE = ("in the bench's own process (every rank), mlxspec's kernels and tape classes taken out "
                  "before each run")
WORKLOADS = ("echo", "mtp-like")
ENGINES = {"echo": ("mlxspec-none", "mlxspec-pld"), "mtp-like": ("mlxspec-mtp",)}
# over several ranks the MTP head also runs split like the target (models/mtp/head.shard_head)
SPLIT_HEAD = "mlxspec-mtp-split-head"
FORWARD_WIDTHS = (2, 3, 4, 5, 8)
# what mlx.launch's backends leave in the environment: which one this run uses
BACKEND_VARS = {"NCCL_HOST_IP": "nccl", "MLX_JACCL_COORDINATOR": "jaccl", "MLX_HOSTFILE": "ring",
                "OMPI_COMM_WORLD_SIZE": "mpi"}


def backend_name() -> str | None:
    return next((name for var, name in BACKEND_VARS.items() if os.environ.get(var)), None)


def cells_of(workloads, sharded: bool = False) -> list[Cell]:
    """The cells of WORKLOADS; SHARDED (over several ranks): the MTP head split as well as whole."""
    out = []
    for w in workloads:
        if w not in ENGINES:
            raise UsageError(f"--sharded runs the workloads {', '.join(WORKLOADS)}; got '{w}'")
        split = (SPLIT_HEAD,) if sharded and w == "mtp-like" else ()
        out += [Cell(w, BASELINE)] + [Cell(w, e) for e in ENGINES[w] + split]
    return out


def shard(model, group) -> None:
    """MODEL made this rank's shard over GROUP by its family's ``shard`` (mlx-lm's tensor
    parallelism); the whole weights it drops are freed."""
    import mlx.core as mx

    if not hasattr(model, "shard"):
        raise UsageError(f"{type(model).__module__} has no shard(): it cannot be sharded by tensor parallelism")
    try:
        model.shard(group)
    except (AssertionError, ValueError) as err:  # mlx-lm asserts what does not divide
        detail = " ".join(str(err).split())[:160] or "its sizes do not divide"
        raise UsageError(f"cannot shard this shape over {group.size()} ranks: {detail}") from None
    mx.eval(model.parameters())
    mx.clear_cache()


def stock_layers(model) -> int:
    """Every layer of MODEL that mlxspec's engine gave a class of its own gets mlx-lm's class
    back (the scripting stays: both engines run it); how many changed."""
    from ..compat import unswap_class
    from .stock_evidence import SCRIPTING

    return sum(unswap_class(m) for _, m in model.named_modules() if type(m).__module__ != SCRIPTING)


class ShardedShapeBench:
    """One shape's sharded model, scripts and MTP head; :meth:`run` generates one cell. The
    attributes :func:`.real_summary.summarize` reads (``shape``, ``scripts``, ``max_tokens``,
    :meth:`ideal`) are those of :class:`.real_shapes.ShapeBench`."""

    def __init__(self, shape: str, group, *, bits: int, prompt_tokens: int, max_tokens: int, workloads,
                 reps: int, seed: int = 0, on_step=None):
        from ..engine.cache import model_nbytes
        from ..models.mtp.head import shard_head
        from .script import make_script
        from .scripted import ScriptedLogits
        from .synthetic import random_model, random_mtp_head, vocab_size

        say = on_step or (lambda *a: None)
        self.shape, self.group, self.max_tokens, self.seed = shape, group, max_tokens, seed
        ranks = group.size() if group is not None else 1
        vocab = vocab_size(shape)
        t0 = time.perf_counter()
        say(f"{shape}: building the target ({bits}-bit)" + (f", sharding it over {ranks} ranks" if group else ""))
        self.model = random_model(shape, bits=bits, kernels=False)
        if group is not None:
            shard(self.model, group)
        self.target_logits = ScriptedLogits(self.model, [0])
        self.head = self.split_head = None
        if "mtp-like" in workloads:
            say(f"{shape}: building the MTP head (whole on every rank)")
            self.head = random_mtp_head(self.model, shape, bits=bits, kernels=False)
            if group is not None:
                say(f"{shape}: building the MTP head split over {ranks} ranks")
                self.split_head = random_mtp_head(self.model, shape, bits=bits, kernels=False)
                shard_head(self.split_head.module, group)
                self.split_head.nbytes = model_nbytes(self.split_head.module)  # this rank's part
        self.kernels = self._kernels_in()
        self.build_s = time.perf_counter() - t0
        self.target_nbytes = model_nbytes(self.model)  # this rank's shard
        self.scripts = {w: make_script(w, vocab, prompt_tokens, max_tokens, seed) for w in workloads}
        say(f"{shape}: timing forwards over a growing cache")
        # every rank times the same forwards (their collectives pair up); rank 0's times are kept
        self.forward = forward_ms(self.model, FORWARD_WIDTHS, prompt_tokens, reps, vocab)
        say(f"{shape}: measuring the costs the gates weigh (as `run` does, rank 0's for all)")
        self.cost, self.head_cost = self._costs(vocab)
        self.evidence_first = self.evidence_last = None

    def _kernels_in(self) -> dict:
        """mlxspec's CUDA kernels into the target and its heads, as a sharded ``run`` loads them
        (a no-op off CUDA or with MLXSPEC_KERNELS=0); what went in."""
        from ..kernels import install

        for head in (self.head, self.split_head):
            if head is not None:
                install(head.module)
        return install(self.model)

    def _costs(self, vocab: int):
        """(the verify-cost model, {engine: its MTP head's step cost}) measured on every rank
        together, rank 0's figures (:mod:`mlxspec.tuning.shared`, as ``run`` measures them)."""
        from ..engine.costs import measure_verify_cost
        from ..tuning.measure import mtp_cost
        from ..tuning.shared import CONTEXT, SHARED_REPS, SHARED_WIDTHS, cost_of, figures, rank0s

        cost = measure_verify_cost(self.model, SHARED_WIDTHS, context=CONTEXT, reps=SHARED_REPS, vocab=vocab)
        heads = {"mlxspec-mtp": self.head, SPLIT_HEAD: self.split_head}
        mine = {**figures(cost),
                "heads": {e: mtp_cost(self.model, h, vocab, CONTEXT, SHARED_REPS) for e, h in heads.items() if h}}
        got = rank0s(mine, self.group)
        return cost_of(got), got["heads"]

    def run(self, cell: Cell, max_tokens: int | None = None) -> Run:
        import mlx.core as mx

        script = self.scripts[cell.workload]
        self.target_logits.table = mx.array(script.target, mx.int32)
        n = max_tokens or self.max_tokens
        mx.synchronize()
        mx.clear_cache()
        if cell.engine == BASELINE:
            return self._stock(script, n)
        return self._mlxspec(script, n, cell)

    def _stock(self, script, n: int) -> Run:
        from ..kernels import uninstall
        from .stock_evidence import evidence
        from .stock_worker import generate

        uninstall(self.model)
        stock_layers(self.model)
        if self.evidence_first is None:
            self.evidence_first = evidence([self.model])
        out = generate(self.model, None, script.prompt, n, 0.0, None, None)
        self.evidence_last = evidence([self.model])  # kept from the last baseline run
        return Run(out["tokens"], out["decode_s"])

    def _mlxspec(self, script, n: int, cell: Cell) -> Run:
        from ..engine.ranks import checked
        from ..engine.sampling import SamplingParams
        from ..engine.speculate import SpeculativeDecoder
        from .script import SteeredLookup, SteeredMTP

        self._kernels_in()  # the baseline run before took them out
        if cell.engine == "mlxspec-pld":
            drafter = SteeredLookup(script) if script.steered else "pld"
        elif cell.engine in ("mlxspec-mtp", SPLIT_HEAD):  # its step's measured cost, as `run` has it
            head = self.head if cell.engine == "mlxspec-mtp" else self.split_head
            drafter = SteeredMTP(head, self.target_nbytes, script, self.head_cost[cell.engine])
        else:
            drafter = "none"
        dec = SpeculativeDecoder(self.model, drafter=drafter, cost=self.cost)
        steps = dec.generate(script.prompt, sampling=SamplingParams(0.0), max_tokens=n)
        if self.group is not None:
            steps = checked(steps, self.group)
        tokens, stamps, stats = [], [], None
        for new, stats in steps:
            if new:
                tokens.extend(new)
                stamps.append(time.perf_counter())
        return Run(tokens, stamps[-1] - stamps[0], stats=stats.to_dict())

    def ideal(self, cell: Cell, run: Run, plain_ms: float) -> None:
        return None  # not modelled for a sharded target: the cells carry the measured forwards instead

    def info(self, bits: int) -> dict:
        from .stock_evidence import failures

        evidence = self.evidence_last or self.evidence_first
        ranks = self.group.size() if self.group is not None else 1
        stock = stock_ok(self.evidence_first) and stock_ok(evidence)
        where = f"{ranks} ranks, {backend_name()}" if ranks > 1 else "one device"
        caption = (f"{BASELINE}: in this process ({where}), "
                   f"mlx-lm's functions its own, nothing of mlxspec bound in mlx / mlx-lm, the model's layers "
                   f"mlx-lm's: {'stock' if stock else 'NOT STOCK'}"
                   + (f" ({len(evidence['originals'])} functions checked against mlx-lm's source)" if evidence else ""))
        return {"baseline_caption": caption, "shape": self.shape, "bits": bits, "ranks": ranks, "kernels": self.kernels,
                "build_s": round(self.build_s, 1), "weights_mb_per_rank": round(self.target_nbytes / 1e6, 1),
                "forward_ms": {str(k): round(v, 3) for k, v in self.forward.items()},
                "cost_curve": {str(k): round(v, 3) for k, v in sorted(self.cost.curve.items())},
                "cost_plain_step": round(self.cost.plain, 3),
                "mtp_step_cost": {k: round(v, 3) for k, v in self.head_cost.items()},
                "baseline": BASELINE, "baseline_runs": WHERE_BASELINE, "baseline_evidence_first": self.evidence_first,
                "baseline_evidence": evidence,
                "baseline_failures": failures(evidence) if evidence else None}


def stock_ok(ev: dict | None) -> bool:
    """In this process the kernels' modules may be imported (the tape's own use): stock means
    nothing of mlxspec bound into mlx / mlx-lm, mlx-lm's functions its own, its layers its own."""
    from .stock_evidence import failures

    return ev is not None and not [f for f in failures(ev) if not f.startswith("imported ")]


def run_sharded(shapes, group, *, bits: int = 4, prompt_tokens: int = 512, max_tokens: int = 128,
                reps: int = 8, workloads=WORKLOADS, seed: int = 0, on_step=None, on_partial=None) -> dict:
    """Every cell of every shape over GROUP (None: this device alone), ``reps`` ABAB
    repetitions against mlx-lm's plain decoding of the same model; the JSON-ready result.
    Every rank runs the same cells in the same order; rank 0's timings are the result."""
    import mlx.core as mx

    from .real_summary import measure, summarize

    if reps < 1 or prompt_tokens < 8 or max_tokens < 2:
        raise UsageError("--reps must be >= 1, --prompt-tokens >= 8 and --max-tokens >= 2")
    cells = cells_of(workloads, sharded=group is not None)
    say = on_step or (lambda *a: None)
    config = {"shapes": list(shapes), "bits": bits, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
              "reps": reps, "order": "ABAB", "workloads": list(workloads), "temperature": 0.0, "seed": seed,
              "ranks": group.size() if group is not None else 1, "backend": backend_name() if group else None,
              "kernels": "mlxspec's CUDA kernels in mlxspec's runs where active (each shape's 'kernels'), "
                         "taken out before every baseline run"}
    cells_out, shapes_out = [], []

    def result(cells_now, infos):
        stock = all(stock_ok(i["baseline_evidence"]) and stock_ok(i["baseline_evidence_first"]) for i in infos)
        return {"baseline": BASELINE, "baseline_runs": WHERE_BASELINE, "baseline_stock": stock, "config": config,
                "shapes": infos, "cells": cells_now}

    for si, shape in enumerate(shapes):
        bench = ShardedShapeBench(shape, group, bits=bits, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                  workloads=workloads, reps=reps, seed=seed,
                                  on_step=lambda m: say(m, si, len(shapes)))
        for cell in cells:  # warm-up: MLX's CUDA backend builds kernels per new input shape
            say(f"{shape}: warm-up {cell.workload} {cell.engine}", si, len(shapes))
            bench.run(cell)

        def partial(rep, runs, pairs):
            if on_partial is not None:
                on_partial(result(cells_out + summarize(bench, cells, runs, pairs), shapes_out + [bench.info(bits)]))

        runs, pairs = measure(bench, cells, reps, lambda m: say(f"{shape}: {m}", si, len(shapes)), partial)
        cells_out += [c | {"ranks": config["ranks"]} for c in summarize(bench, cells, runs, pairs)]
        shapes_out.append(bench.info(bits))
        bench = None
        mx.clear_cache()
    say("done", len(shapes), len(shapes))
    return result(cells_out, shapes_out)
