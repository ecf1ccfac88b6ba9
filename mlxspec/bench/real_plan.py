"""The plan of ``mlxspec bench --real-shapes``: its workloads, engines and cells (no mlx at import).

Engines: :data:`BASELINE` and :data:`STOCK_DRAFT` are stock mlx-lm, run in a process of its own
that never imports mlxspec's kernels (:mod:`.stock_worker`, proven by :mod:`.stock_evidence`);
:data:`WITH_KERNELS` is mlx-lm's plain decoding in the bench's own process, where the model
carries mlxspec's CUDA kernels as a loaded checkpoint does; the ``mlxspec-*`` engines are ours.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

PROFILE_WORKLOADS = ("dflash", "mtp-like")  # script.PROFILES, named here without importing mlx

WORKLOADS = ("echo", "novel", "scripted-a0.8", "scripted-a0.6", "scripted-a1.0")
DEFAULT_SHAPES = ("qwen3-1.7b", "qwen3-8b", "qwen3.6-27b", "qwen3.6-35b-a3b")
DRAFT_SHAPE = "qwen3-0.6b"
BASELINE = "mlx-lm (stock)"  # mlx-lm's generate_step in a process of its own (.stock_worker)
STOCK_DRAFT = "mlx-lm-draft (stock)"  # mlx-lm's speculative_generate_step with the draft model, there too
WITH_KERNELS = "mlx-lm + mlxspec kernels"  # generate_step in the bench's process, on its model (kernels installed)
STOCK_ENGINES = (BASELINE, STOCK_DRAFT)
ENGINES = (BASELINE, STOCK_DRAFT, WITH_KERNELS, "mlxspec-none", "mlxspec-pld", "mlxspec-mtp", "mlxspec-draft",
           "mlxspec-assistant", "mlxspec-dflash")
# --engines names for the cells' engines (the CLI's spelling: no spaces); the baseline always runs
ENGINE_FLAGS = {"mlx-lm": BASELINE, "mlx-lm-draft": STOCK_DRAFT, "mlx-lm-kernels": WITH_KERNELS,
                **{e: e for e in ENGINES if e.startswith("mlxspec-")}}
DFLASH_CHAINS = (3, 7, 15)  # forced chain depths: blocks of 4, 8 and 16
DFLASH_TREES = (4, 8, 16, 32)  # draft-tree node budgets
MLX_LM_DRAFT_DEPTH = 3  # the stock draft loop's num_draft_tokens, as in `mlxspec bench`


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
    a seeded pass at ``temperature`` (None: none); the first plain workload also runs mlx-lm
    with mlxspec's kernels (:data:`WITH_KERNELS`). ``assistant``: a Gemma-4 target, whose model
    drafter is its assistant (no MTP head, no separate draft model, no mlx-lm draft loop).
    ``dflash_block``: the block size of the shape's DFlash drafter (None: it has none)."""
    drafter = "mlxspec-assistant" if assistant else "mlxspec-mtp"
    cells = []
    plain = [w for w in workloads if w not in PROFILE_WORKLOADS]
    for w in workloads:
        if w in PROFILE_WORKLOADS:
            cells += profile_cells(w, assistant, dflash_block)
            continue
        cells.append(Cell(w, BASELINE))
        if w == plain[0]:  # what mlxspec's kernels do to mlx-lm's own plain decoding: once a shape
            cells.append(Cell(w, WITH_KERNELS))
        if w in ("echo", "novel"):
            cells += [Cell(w, e) for e in ("mlxspec-none", "mlxspec-pld", drafter)]
        else:
            cells.append(Cell(w, drafter))
            if not assistant:
                cells.append(Cell(w, "mlxspec-draft"))
            if dense and not assistant:  # mlx-lm cannot roll back the hybrids' GatedDeltaNet caches
                cells.append(Cell(w, STOCK_DRAFT))
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


def known_names(text: str, known, flag: str, what: str) -> list[str]:
    """TEXT's comma-separated names, each one of KNOWN, at least one (a UsageError naming FLAG
    and WHAT otherwise)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UsageError(f"{flag} needs at least one {what}")
    for name in names:
        if name not in known:
            raise UsageError(f"unknown {what} '{name}' for --real-shapes; choose from {', '.join(known)}")
    return names


def parse_engines(text: str | None) -> frozenset[str] | None:
    """``--engines`` of ``--real-shapes``: the engines whose cells run, the stock baseline always
    among them (every ratio is against it); None (no flag): every cell of the plan."""
    if text is None:
        return None
    return frozenset([BASELINE, *(ENGINE_FLAGS[n] for n in known_names(text, ENGINE_FLAGS, "--engines", "engine"))])


def parse_shapes(text: str) -> list[str]:
    from .synthetic import SHAPES

    if text.strip() == "all":
        return list(DEFAULT_SHAPES)
    return known_names(text, SHAPES, "--real-shapes", "shape")
