"""Commands for this machine: tune, config, profile (and the preset policy run and serve share).

They register on the one Typer app of :mod:`mlxspec.cli`, which imports this module.
"""

import json
import sys
from typing import Annotated, Optional

import typer

from ..config import user_config_path
from ..errors import UsageError
from .app import app
from .console import (
    complete_model,
    help_text,
    load_with_spinner,
    model_errors,
    print_note,
    stderr_console,
    stdout_console,
    user_errors,
)

# -- the tune command --------------------------------------------------------

TUNE_HELP = help_text("""
Measure on this machine what speculation costs and gains with MODEL, and store it.

It times a verify forward of 1 to 16 tokens and one draft step of each drafter (prompt lookup,
the --draft-model, the model's MTP head if it has one), runs each drafter at depth 8 on a few
built-in prompts (a code edit, code completion, prose) to measure acceptance per draft
position, and picks the depth with the best expected speed per drafter. The result is stored
per machine and model (the path is printed at the end). `run` and `serve` then use it: the
stored cost curve instead of measuring one (a run without a tune measures it once and stores
it), the tuned depth as the cap of the adaptive depth, and, for drafter auto, the drafter rated
fastest here (a note says when that differs from auto's usual pick).
""")


@app.command(help=TUNE_HELP)
def tune(
    model: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", show_default=False, autocompletion=complete_model,
        help="Local model folder or cached Hugging Face repo id (default: the configured or demo model).")] = None,
    draft_model: Annotated[Optional[str], typer.Option(
        "--draft-model", metavar="PATH_OR_REPO",
        help="Small model sharing MODEL's tokenizer, to tune the draft-model drafter too.")] = None,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="Tokens generated per prompt and drafter while measuring acceptance.")] = 96,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the stored result as JSON instead of tables.")] = False,
) -> None:
    with user_errors():
        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
        from ..hub import expand_alias
        from ..tuning.measure import run_tune
        from .tune_report import render_tune_result, with_conclusion

        spec = load_with_spinner(expand_alias(model), expand_alias(draft_model))
        console = stderr_console()
        if console.is_terminal:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                task = progress.add_task("tuning", total=None)

                def on_step(message, done, total):
                    progress.update(task, description=message, completed=done, total=total)

                result = run_tune(spec, max_tokens=max_tokens, on_step=on_step)
        else:
            result = run_tune(spec, max_tokens=max_tokens)
        if json_out:
            sys.stdout.write(json.dumps(with_conclusion(result)) + "\n")
            sys.stdout.flush()
            return
        out = stdout_console()
        render_tune_result(result, out, chart=out.is_terminal and out.encoding.lower().startswith("utf"))
        print_note(f"saved to {result['path']}")


# -- the config command ------------------------------------------------------

config_app = typer.Typer(help="Show the effective settings or the config file's path.",
                         no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show", help="The effective settings, each with where it came from: "
                                 "flag, env ($MLXSPEC_*), file (config.toml) or default.")
def config_show(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    with user_errors():
        from ..config import SETTINGS, aliases, settings_with_sources

        effective = settings_with_sources()
        table = {name: {"value": value, "source": source, "env": SETTINGS[name][2],
                        "key": SETTINGS[name][3]} for name, (value, source) in effective.items()}
        found = aliases()
        path = user_config_path()
        if json_out:
            sys.stdout.write(json.dumps({"file": str(path), "file_exists": path.is_file(),
                                         "settings": table, "aliases": found}) + "\n")
            return
        from rich.table import Table

        view = Table(title=f"settings ({path}{'' if path.is_file() else ', not present'})",
                     title_justify="left")
        for col in ("setting", "value", "from", "env / file key"):
            view.add_column(col)
        for name, row in table.items():
            view.add_row(name, "-" if row["value"] is None else str(row["value"]), row["source"],
                         f"${row['env']} / {row['key']}")
        for name, ref in found.items():
            view.add_row(f"alias {name}", ref, "file", f"aliases.{name}")
        stdout_console().print(view)


@config_app.command("path", help="The config file's path (it may not exist yet).")
def config_path() -> None:
    sys.stdout.write(str(user_config_path()) + "\n")


# -- the profile command and --preset ----------------------------------------

PROFILE_HELP = help_text("""
Show this machine: chip, CPU/GPU cores, memory, MLX's recommended working set, memory bandwidth,
OS and MLX versions. With MODEL (and --draft-model), also what `--preset auto` would choose for
it and why.
""")


def _flag_given(ctx, name: str) -> bool:
    """Whether option NAME was typed on the command line (not a default, env or config value)."""
    try:  # by name: Typer may ship its own copy of click, with its own ParameterSource enum
        return ctx is not None and getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"
    except Exception:
        return False


def prepare_run(preset, model, drafter, draft_model, ctx=None):
    """--preset and the memory check for run and serve (mlxspec.presets.plan_run decides): its
    notes printed, memory wired for the weights -> (drafter, draft_model, extra stream options)."""
    from ..presets import plan_run

    plan = plan_run(preset, model, drafter, draft_model, drafter_given=_flag_given(ctx, "drafter"))
    for note in plan.notes:
        print_note(note)
    plan.apply_memory_limits()
    return plan.drafter, plan.draft_model, plan.stream_options


def _profile_lines(data: dict) -> list[tuple[str, str]]:
    from ..units import human_bytes

    tiers = " + ".join(f"{n} {name}" for name, n in data["cpu_core_tiers"].items())
    cpu = "?" if data["cpu_cores"] is None else f"{data['cpu_cores']} cores" + (f" ({tiers})" if tiers else "")
    rows = [("chip", data["chip"] or "unknown"), ("cpu", cpu)]
    if data["gpu"] or data["gpu_cores"]:
        rows.append(("gpu", f"{data['gpu'] or 'GPU'}" + (f", {data['gpu_cores']} cores" if data["gpu_cores"] else "")))
    mem = human_bytes(data["memory_bytes"]) + (" unified" if data["os"] == "macOS" else " RAM")
    if data["working_set_bytes"]:
        mem += f", recommended working set {human_bytes(data['working_set_bytes'])}"
    rows.append(("memory", mem))
    bw = "unknown"
    if data["bandwidth_gbs"]:
        bw = f"{data['bandwidth_gbs']:g} GB/s ({data['bandwidth_source']})"
    rows.append(("bandwidth", bw))
    rows.append(("os", " ".join(x for x in (data["os"], data["os_version"], data["arch"]) if x) or "unknown"))
    rows.append(("mlx", f"{data['mlx_version'] or 'not installed'} (default device {data['mlx_device'] or '?'})"))
    return rows


@app.command(help=PROFILE_HELP)
def profile(
    model: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", show_default=False, autocompletion=complete_model,
        help="Also show what --preset auto would choose for this model folder or cached repo id.")] = None,
    draft_model: Annotated[Optional[str], typer.Option(
        "--draft-model", metavar="PATH_OR_REPO", help="A draft model to consider for MODEL.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    with user_errors():
        from .. import hardware, presets

        prof = hardware.detect()
        data = prof.to_dict()
        if model is not None or draft_model is not None:
            with model_errors(model, draft_model):
                caps = presets.model_caps(model, draft_model)
            chosen, reasons = presets.choose(prof, caps)
            data["auto"] = {"model": caps.name, "model_bytes": caps.model_bytes,
                            "has_mtp_head": caps.has_mtp_head, "draft_model": caps.draft_name,
                            "draft_kind": caps.draft_kind, "draft_found": caps.draft_found,
                            "draft_bytes": caps.draft_bytes, "preset": chosen.name,
                            "drafter": chosen.drafter, "max_depth": chosen.max_depth,
                            "gates": chosen.gates, "reasons": reasons}
        if json_out:
            sys.stdout.write(json.dumps(data) + "\n")
            return
        rows = _profile_lines(data)
        if "auto" in data:
            rows.append(("auto", f"{data['auto']['preset']} for {data['auto']['model']}: "
                                 + "; ".join(data["auto"]["reasons"])))
        for label, value in rows:
            sys.stdout.write(f"{label:<10} {value}\n")
        sys.stdout.flush()
