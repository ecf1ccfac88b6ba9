"""What ``mlxspec bench`` writes: the JSON document (every raw number, medians, environment),
Rich tables and a matplotlib bar chart. Tables and chart are made from the JSON alone, so
``mlxspec bench --from-json results.json --png chart.png`` redraws a saved run."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..errors import MlxspecError, UsageError
from .prompts import BASELINE, ENGINE_HELP, ENGINES, SCHEMA, TTFT, TTFT_NOTE

PNG_HINT = 'the chart needs matplotlib: pip install "mlxspec[bench]"'


def environment() -> dict:
    """Versions, device and the exact command line of this process."""
    import mlx.core as mx

    from .. import __version__

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except (ImportError, AttributeError):
        mlx_lm_version = None
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float, bool))}
    except Exception:  # not every backend describes its device
        info = {}
    from ..kernels import ENV, active
    from ..kernels.qmm import MAX_ROWS, MIN_ROWS, TC_ROWS

    return {
        "mlxspec": __version__, "mlx": mx.__version__, "mlx_lm": mlx_lm_version,
        "device": str(mx.default_device()), "device_info": info,
        "kernels": {"active": active(), ENV: os.environ.get(ENV), "qmm_rows": [MIN_ROWS, MAX_ROWS],
                    "tensor_core_rows": [TC_ROWS.start, TC_ROWS.stop - 1] if TC_ROWS else None},
        "compiled": compiled_switches(),
        "python": platform.python_version(), "platform": platform.platform(),
        "command": _command_line(), "argv": list(sys.argv), "executable": sys.executable,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def compiled_switches() -> dict:
    """Which of the engine's forwards this process runs as compiled graphs (each switch is read
    once, at import, from its ``MLXSPEC_COMPILED_*`` variable): what a run timed."""
    from ..engine import compiled_forward, compiled_head

    return {"verify": compiled_forward.row_verify, "hybrid_verify": compiled_forward.hybrid_verify,
            "plain": compiled_forward.plain_steps, "batch": compiled_forward.batch_forward,
            "head": compiled_head.enabled}


def compiled_graphs() -> dict:
    """The compiled graphs of the models alive (``compiled_forward.traces``): how many were
    traced and the host seconds of the calls that traced them (the trace, its first run and, on
    a fresh CUDA machine, NVRTC building the fused kernels)."""
    from ..engine.compiled_forward import traces

    graphs, trace_s = traces()
    return {"traced": graphs, "tracing_calls_s": round(trace_s, 3)}


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):  # python -m mlxspec
        argv[:1] = [Path(sys.executable).name, "-m", "mlxspec"]
    elif argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def model_info(loaded) -> dict | None:
    if loaded is None:
        return None
    cfg = loaded.config
    text = cfg.get("text_config") or {}
    return {"name": loaded.name, "path": str(loaded.path), "model_type": cfg.get("model_type"),
            "quantization": cfg.get("quantization") or text.get("quantization")}


def bench_document(bench, result: dict) -> dict:
    """The JSON of an engine benchmark: config, workloads, engines, passes (raw runs + results)."""
    o = bench.options
    engines = {e: {"status": "ok", "what": ENGINE_HELP[e]} for e in bench.engines}
    engines.update({e: {"status": "skipped", "reason": why, "what": ENGINE_HELP[e]}
                    for e, why in bench.skipped.items()})
    from .fim import with_per_prompt

    return with_per_prompt({
        "schema": SCHEMA, "kind": "bench", "environment": environment(),
        "model": model_info(bench.spec.target), "draft_model": model_info(bench.spec.draft),
        "config": {"reps": o.reps, "draft_depth": o.draft_depth, "depth": o.depth,
                   "temperature": o.temperature, "temp_pass": o.temp_pass, "seed": o.seed,
                   "gates": o.gates, "ttft": TTFT, "ttft_note": TTFT_NOTE},
        "workloads": {w.name: {"file": str(w.path), **(w.details or {}), "prompts": [
            {"id": p.id, "prompt_tokens": len(p.ids), "max_tokens": p.max_tokens, **p.meta} for p in w.prompts]}
            for w in bench.workloads},
        "engines": engines,
        **result,
    })


def sweep_document(sweep: dict) -> dict:
    return {"schema": SCHEMA, "kind": "sweep", "environment": environment(), "sweep": sweep}


def real_shapes_document(result: dict) -> dict:
    """``bench --real-shapes``: ``device``, ``mlx`` and ``cells`` at the top for scripts."""
    env = environment()
    name = env["device_info"].get("device_name") or env["device"]
    return {"schema": SCHEMA, "kind": "real_shapes", "device": name, "mlx": env["mlx"],
            "baseline": result.get("baseline", "mlx-lm"), "cells": result["cells"], "environment": env,
            "real_shapes": result}


def real_concurrency_document(result: dict) -> dict:
    """``bench --real-shapes SHAPE --concurrency``: ``device``, ``baseline`` and ``cells`` at the top."""
    env = environment()
    name = env["device_info"].get("device_name") or env["device"]
    return {"schema": SCHEMA, "kind": "real_concurrency", "device": name, "mlx": env["mlx"],
            "baseline": result["baseline"], "cells": result["cells"], "environment": env, "real_concurrency": result}


def chat_document(models: list[dict], config: dict) -> dict:
    """The JSON of ``bench --chat``: the plan (config) and, per model, every run and the
    per-turn medians (:func:`mlxspec.bench.chat.run_chat`)."""
    return {"schema": SCHEMA, "kind": "chat", "environment": environment(),
            "chat": {"config": config, "models": models}}


def write_json(doc: dict, path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def read_json(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--from-json: no file '{path}'") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MlxspecError(f"--from-json: '{path}' is not a bench JSON file ({err})") from None
    kinds = ("bench", "sweep", "chat", "real_shapes")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("kind") not in kinds:
        raise MlxspecError(f"--from-json: '{path}' was not written by `mlxspec bench --json` ({SCHEMA})")
    return doc


# -- tables -----------------------------------------------------------------------------


def _fmt(value, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def pass_table(doc: dict, p: dict):
    from rich.table import Table

    model = (doc.get("model") or {}).get("name", "?")
    reps = doc.get("config", {}).get("reps", "?")
    sampled = p["temperature"] > 0
    title = (f"{model} on {doc['environment'].get('device', '?')}: temperature {p['temperature']:g}"
             + (f" (seed {p['seed']})" if sampled else "")
             + f", median of {reps} repetition{'s' * (reps != 1)}")
    table = Table(title=title, title_justify="left")
    ttft = doc.get("config", {}).get("ttft")  # absent in files written before it was said
    for name in ("workload", "engine", "tok/s", "speedup", "accept", "acc. len", "from draft",
                 f"{ttft} TTFT ms" if ttft else "TTFT ms", "peak MB", "identical"):
        table.add_column(name, justify="left" if name in ("workload", "engine") else "right", no_wrap=True)
    skipped = {}
    last = None
    for row in p["results"]:
        if row["status"] != "ok":
            skipped[row["engine"]] = row["reason"]
            continue
        m = row["median"]
        same = "-" if row["identical"] is None else "yes" if row["identical"] else "NO"
        table.add_row("" if row["workload"] == last else row["workload"], row["engine"],
                      _fmt(m["tps"], ".1f"), _fmt(row["speedup"], ".2f") + ("x" if row["speedup"] else ""),
                      _fmt(m["acceptance"], ".0%"), _fmt(m["mean_accepted_length"], ".2f"),
                      _fmt(m["draft_fraction"], ".0%"), _fmt(m["ttft_ms"], ".1f"),
                      _fmt(m["peak_mb"], ".0f"), same,
                      end_section=False)
        last = row["workload"]
    notes = [f"speedup: decode tok/s over {BASELINE}'s; identical: tokens equal to {BASELINE}'s "
             f"at every prompt and repetition ({BASELINE}: equal to its own first repetition)"]
    if ttft:
        notes.append(doc["config"].get("ttft_note") or f"TTFT: {ttft}")
    notes += [f"skipped {engine}: {why}" for engine, why in skipped.items()]
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table


def chat_table(doc: dict, m: dict):
    """One model's turns: prompt and cached tokens, TTFT without and with reuse and mlx-lm's."""
    from rich.table import Table

    c = doc["chat"]["config"]
    reps = c["reps"]
    if m.get("random_weights"):
        what = f"random {m['bits']}-bit weights" if m["bits"] else "random bf16 weights"
        what += f" (cast to {m['dtype']})" if m.get("dtype") else ""
    else:
        what = f"weights cast to {m['dtype']}" if m.get("dtype") else "weights as stored"
    table = Table(title=f"{m['name']} on {doc['environment'].get('device', '?')}: time to first token per "
                        f"chat turn, median of {reps} repetition{'s' * (reps != 1)}", title_justify="left")
    for name in ("turn", "prompt", "cached", "no reuse ms", "reuse ms", "mlx-lm ms", "speedup",
                 "identical", "= mlx-lm"):
        table.add_column(name, justify="right", no_wrap=True)
    for t in m["turns"]:
        ms = t["ttft_ms"]
        table.add_row(str(t["turn"]), str(t["prompt_tokens"]), f"{t['cached_tokens']:.0f}",
                      f"{ms['no_reuse']:.1f}", f"{ms['reuse']:.1f}", f"{ms['mlx_lm']:.1f}",
                      _fmt(t["ratio"], ".2f") + ("x" if t["ratio"] else ""),
                      "yes" if t["identical"] else "NO", "yes" if t["identical_mlx_lm"] else "no")
    table.caption = "\n".join([
        f"{what}, drafter {c['drafter']}, temperature 0",
        f"user blocks: {c['first_user_tokens']} tokens, then {c['user_tokens']}; answers: {c['answer_tokens']} tokens",
        "speedup: no-reuse TTFT / reuse TTFT",
        "identical: reuse tokens = no-reuse tokens, every repetition",
        "= mlx-lm: no-reuse tokens = mlx-lm's greedy tokens, every repetition"])
    table.caption_justify = "left"
    return table


def real_shapes_table(doc: dict, shape: str):
    """Rich table of one shape's cells."""
    from rich.table import Table

    env = doc.get("environment", {})
    order = doc.get("real_shapes", {}).get("config", {}).get("order")  # older documents: no ABAB pairing
    how = "paired median of ABAB reps, IQR" if order == "ABAB" else "median of reps"
    table = Table(title=f"{shape} on {env.get('device_name') or env.get('device', '?')}: speedup over "
                        f"{doc.get('baseline', 'mlx-lm')} ({how})", title_justify="left")
    info = next((i for i in doc.get("real_shapes", {}).get("shapes", []) if i.get("shape") == shape), {})
    ev = info.get("baseline_evidence")
    if info.get("baseline_caption"):  # bench --sharded: the baseline ran in the bench's own processes
        table.caption = info["baseline_caption"]
        table.caption_justify = "left"
    elif ev is not None:  # .stock_evidence: what the baseline process showed of itself
        table.caption = (f"{doc['baseline']}: its own process, no mlxspec kernel imported or bound in mlx-lm: "
                         f"{'stock' if ev['stock'] else 'NOT STOCK'} ({len(ev['originals'])} functions checked "
                         "against mlx-lm's source)")
        table.caption_justify = "left"
    for col in ("workload", "engine", "depth", "tree", "temp", "tok/s", "speedup", "IQR", "ideal", "ach/ideal",
                "accept", "tok/step", "identical"):
        table.add_column(col, justify="left" if col in ("workload", "engine") else "right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for c in doc["cells"]:
        if c["shape"] != shape:
            continue
        iqr = c.get("speedup_iqr")  # older documents have none
        tree = c.get("tree") or "-"
        if c.get("tree") == "auto" and c.get("tree_steps") is not None:  # what the cost model chose
            tree = f"auto ({c['tree_steps']} x {c['mean_tree_nodes']:g})" if c["tree_steps"] else "auto (chains)"
        table.add_row(c["workload"], c["engine"], str(c["depth"]), str(tree), f"{c['temperature']:g}",
                      fmt(c["tps"], ".1f"), fmt(c["speedup"], ".2f") + "x",
                      f"{iqr[0]:.2f}-{iqr[1]:.2f}" if iqr else "-", fmt(c["ideal"], ".2f"),
                      fmt(c["achieved_over_ideal"], ".2f"), fmt(c["acceptance"], ".0%"),
                      fmt(c["tokens_per_step"], ".2f"), "yes" if c["identical"] else "NO")
    return table


def render(doc: dict, console) -> None:
    """Print a document's tables: one per pass, the sweep's, or one per chat model."""
    if not console.is_terminal:  # a file or pipe has no width: do not squeeze the columns
        from rich.console import Console

        console = Console(file=console.file, width=160, highlight=False, color_system=None)
    if doc["kind"] == "sweep":
        from .sweep import sweep_table

        console.print(sweep_table(doc["sweep"]))
        return
    if doc["kind"] == "chat":
        for m in doc["chat"]["models"]:
            console.print(chat_table(doc, m))
        return
    if doc["kind"] == "real_shapes":
        for shape in dict.fromkeys(c["shape"] for c in doc["cells"]):
            console.print(real_shapes_table(doc, shape))
        return
    from .fim import FIM, prompt_table

    built = [name for name, w in doc.get("workloads", {}).items() if w.get("kind") == FIM]
    for p in doc["passes"]:
        console.print(pass_table(doc, p))
        for name in built:  # the fim workload: a row per span too
            console.print(prompt_table(doc, p, name))


# -- chart ------------------------------------------------------------------------------


def check_matplotlib() -> None:
    import importlib

    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise MlxspecError(PNG_HINT) from None


def real_shapes_chart(doc: dict, shape: str, ax) -> None:
    """Speedup against forced depth at full acceptance (pld and mtp), with the ideal from the
    measured forwards; the engines' own choices on each workload as points at depth 0."""
    cells = [c for c in doc["cells"] if c["shape"] == shape and c["temperature"] == 0]
    for i, engine in enumerate(("mlxspec-pld", "mlxspec-mtp", "mlxspec-assistant")):
        forced = sorted((c["depth"], c["speedup"], c["ideal"]) for c in cells
                        if c["engine"] == engine and c["workload"] == "scripted-a1.0"
                        and c["depth"] != "auto")
        if forced:
            ax.plot([f[0] for f in forced], [f[1] for f in forced], marker="o", color=f"C{i}",
                    label=f"{engine} achieved")
            ax.plot([f[0] for f in forced], [f[2] for f in forced], linestyle="--", color=f"C{i}",
                    label=f"{engine} ideal")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("forced depth (drafts per verify), every draft accepted")
    ax.set_ylabel(f"speedup over {doc.get('baseline', 'mlx-lm')}")
    ax.set_title(f"{shape} ({doc.get('device', '?')})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _speedup_bars(doc: dict, p: dict, ax) -> None:
    rows = [r for r in p["results"] if r["status"] == "ok" and r["engine"] != BASELINE]
    workloads = list(dict.fromkeys(r["workload"] for r in p["results"]))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    width = 0.8 / max(len(engines), 1)
    for i, engine in enumerate(engines):
        values = {r["workload"]: r["speedup"] or 0.0 for r in rows if r["engine"] == engine}
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(workloads))]
        color = f"C{ENGINES.index(engine) % 10}"  # one colour per engine in every panel
        bars = ax.bar(xs, [values.get(w, 0.0) for w in workloads], width, label=engine, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel(f"decode speedup over {BASELINE}")
    model = (doc.get("model") or {}).get("name", "?")
    ax.set_title(f"{model}, temperature {p['temperature']:g} ({doc['environment'].get('device', '?')})",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    skipped = list(dict.fromkeys(r["engine"] for r in p["results"] if r["status"] != "ok"))
    if skipped:
        ax.annotate("skipped: " + ", ".join(skipped), (0, 0), xycoords="axes fraction",
                    xytext=(4, -26), textcoords="offset points", fontsize=7, color="gray")


def write_chart(docs: list[dict], path: str) -> None:
    """One panel per pass of each bench document (speedup per workload and engine), one per
    sweep (cost ratio against tokens per forward), one per chat run (TTFT per turn)."""
    check_matplotlib()
    from matplotlib.figure import Figure

    from .chat import chat_chart
    from .sweep import sweep_chart

    def parts(doc):
        if doc["kind"] == "bench":
            return doc["passes"]
        if doc["kind"] == "real_shapes":
            return list(dict.fromkeys(c["shape"] for c in doc["cells"]))
        return [None]

    panels = [(doc, p) for doc in docs for p in parts(doc)]
    fig = Figure(figsize=(10, 3.8 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (doc, p) in zip(axes, panels):
        if doc["kind"] == "real_shapes":
            real_shapes_chart(doc, p, ax)
        elif doc["kind"] == "chat":
            chat_chart(doc["chat"], ax, doc["environment"].get("device"))
        elif p is None:
            sweep_chart(doc["sweep"], ax, doc["environment"].get("device"))
        else:
            _speedup_bars(doc, p, ax)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
