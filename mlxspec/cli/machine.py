"""Commands for models and machines: convert, tune, config, pull, list, rm, profile.

They register on the one Typer app of :mod:`mlxspec.cli`, which imports this module.
"""

import contextlib
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
    print_note,
    stderr_console,
    stdout_console,
    user_errors,
)

# -- the convert command -----------------------------------------------------

CONVERT_HELP = help_text("""
Convert the Hugging Face checkpoint HF_PATH to MLX in OUT, keeping its MTP head.

The trunk goes through mlx-lm's own converter (same weights, config and tokenizer files as
`mlx_lm.convert`); the multi-token-prediction head that converter drops is written next to it
as OUT/mtp.safetensors, which `mlxspec run OUT --drafter mtp` uses. HF_PATH is a local folder
or a repo id already in the local Hugging Face cache (nothing is downloaded). A checkpoint
without a head is converted all the same.
""")


@app.command(help=CONVERT_HELP)
def convert(
    hf_path: Annotated[str, typer.Argument(
        metavar="HF_PATH", show_default=False,
        help="Hugging Face checkpoint: a local folder or a cached repo id.")],
    out: Annotated[str, typer.Argument(
        metavar="OUT", show_default=False, help="Folder to write the MLX checkpoint to.")],
    q_bits: Annotated[Optional[int], typer.Option(
        "--q-bits", help="Quantize the trunk to this many bits (4 or 8; also 2, 3, 5, 6). "
                         "Default: no quantization.", show_default=False)] = None,
    q_group_size: Annotated[int, typer.Option(
        "--q-group-size", help="Quantization group size: 32, 64 or 128.")] = 64,
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="bfloat16, float16 or float32 for the unquantized tensors "
                        "(default: the checkpoint's own dtype, as mlx-lm picks it).",
        show_default=False)] = None,
    mtp_bits: Annotated[Optional[int], typer.Option(
        "--mtp-bits", help="Bits for the MTP head's linear weights (default: as --q-bits); "
                           "0 keeps the head unquantized.", show_default=False)] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace OUT if it exists and is not empty.")] = False,
) -> None:
    with user_errors():
        from ..models.convert import convert_checkpoint
        from ..units import human_bytes

        console = stderr_console()
        status = console.status("starting…", spinner="dots") if console.is_terminal else None
        with status if status else contextlib.nullcontext():
            result = convert_checkpoint(
                hf_path, out, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype,
                mtp_bits=mtp_bits, force=force,
                on_step=(lambda message: status.update(message + "…")) if status else None)
        for note in result.notes:
            print_note(note)
        trunk = (f"{result.q_bits}-bit (group {result.q_group_size})" if result.q_bits
                 else (result.dtype or "unquantized"))
        if result.head_kept:
            layers = f"{result.head_layers} layer{'s' * (result.head_layers != 1)}"
            bits = (f"{result.head_bits}-bit" if result.head_bits else
                    "as stored" if result.head_family == "nextn" else "unquantized")
            head = f"MTP head kept ({layers}, {result.head_tensors} tensors, {bits}, mtp.safetensors)"
        else:
            head = "no MTP head"
        sys.stdout.write(f"converted to {result.out} ({human_bytes(result.size_bytes)}, {trunk}); {head}\n")
        sys.stdout.flush()


# -- the tune command --------------------------------------------------------

TUNE_HELP = help_text("""
Measure on this machine what speculation costs and gains with MODEL, and store it.

It times a verify forward of 1 to 16 tokens and one draft step of each drafter (prompt lookup,
the --draft-model, the model's MTP head if it has one), runs each drafter at depth 8 on a few
built-in prompts (a code edit, code completion, prose) to measure acceptance per draft
position, and picks the depth with the best expected speed per drafter. The result is stored
per machine and model (the path is printed at the end); `run` then
uses the stored cost curve instead of measuring it at load.
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
        from .tune_report import render_tune_result

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
            sys.stdout.write(json.dumps(result) + "\n")
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


# -- the pull, list and rm commands (model cache) ------------------------------

PULL_HELP = help_text("""
Download MODEL into the Hugging Face cache, where `mlxspec run`, mlx-lm and other tools find it.

MODEL is a repo id (org/name) or a short alias from mlxspec's catalog (see `mlxspec list
--catalog`). Only the files a model needs are fetched: weights, config, tokenizer, chat template
and, unless --no-include-mtp, an MTP head sidecar. Files already cached are skipped, so running
the command again after an interruption finishes the download. HF_HOME, HF_HUB_CACHE, HF_TOKEN,
HF_ENDPOINT and HF_HUB_OFFLINE are honoured.
""")


def pull_with_progress(model: str, revision: Optional[str], include_mtp: bool):
    from .. import hub

    console = stderr_console()
    if not console.is_terminal:
        return hub.pull(model, revision=revision, include_mtp=include_mtp)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=False)
    state = {"task": None}
    repo_id = hub.to_repo_id(model)

    def on_start(files: int, total: int) -> None:
        if files:
            state["task"] = progress.add_task(f"{repo_id} ({files} file{'s' * (files != 1)})", total=total or None)

    def on_bytes(n: int) -> None:
        if state["task"] is not None:
            progress.advance(state["task"], n)

    with progress:
        status = progress.add_task("resolving…", total=None, visible=True)
        progress.update(status, description=f"resolving {repo_id}…")
        try:
            return hub.pull(model, revision=revision, include_mtp=include_mtp,
                            on_start=lambda f, t: (progress.remove_task(status), on_start(f, t)),
                            on_bytes=on_bytes)
        finally:
            if status in progress.task_ids:
                progress.remove_task(status)


@app.command(help=PULL_HELP)
def pull(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", show_default=False, autocompletion=complete_model,
        help="Repo id (org/name) or catalog alias.")],
    revision: Annotated[Optional[str], typer.Option(
        "--revision", help="Branch, tag or commit to download (default: main).", show_default=False)] = None,
    include_mtp: Annotated[bool, typer.Option(
        "--include-mtp/--no-include-mtp", help="Also fetch an MTP head sidecar (mtp.safetensors, "
                                               "mtp/*.safetensors, model-mtp.safetensors).")] = True,
) -> None:
    with user_errors():
        from ..units import human_bytes

        result = pull_with_progress(model, revision, include_mtp)
        what = ("already in the cache" if result.already_cached else
                f"downloaded {result.files} file{'s' * (result.files != 1)}, {human_bytes(result.downloaded_bytes)}")
        pin = f"@{result.revision}" if result.revision != "main" else ""
        sys.stdout.write(f"{result.repo_id}{pin}: {what} ({result.path})\n")
        sys.stdout.flush()


def _list_table(rows: list) -> None:
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for column, justify in (("MODEL", "left"), ("SIZE", "right"), ("ARCH", "left"), ("QUANT", "left"),
                            ("MTP", "left"), ("CONTEXT", "right")):
        table.add_column(column, justify=justify, no_wrap=column != "MODEL")
    for row in rows:
        quant = row["quantization"]
        table.add_row(row["repo_id"], row["size"], row["architecture"] or "?",
                      f"{quant['bits']}-bit/g{quant['group_size']}" if quant else "-",
                      "yes" if row["mtp"] else "-",
                      f"{row['context_length']:,}" if isinstance(row["context_length"], int) else "?")
    stdout_console().print(table)


@app.command(name="list")
def list_models(
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list of objects.")] = False,
    show_catalog: Annotated[bool, typer.Option(
        "--catalog", help="List the aliases `mlxspec pull` knows instead of the cached models.")] = False,
) -> None:
    """List the models in the Hugging Face cache: size, architecture, quantization, MTP head, context."""
    with user_errors():
        from .. import hub

        if show_catalog:
            rows = [{"alias": e.alias, "repo_id": e.repo, "mtp": e.mtp, "draft": e.draft, "note": e.note}
                    for e in hub.catalog().values()]
            if json_out:
                sys.stdout.write(json.dumps(rows) + "\n")
            else:
                for row in rows:
                    extra = ", MTP head" if row["mtp"] else (f", draft: {row['draft']}" if row["draft"] else "")
                    sys.stdout.write(f"{row['alias']:<14} {row['repo_id']}{extra}\n")
            return
        rows = hub.list_models()
        if json_out:
            sys.stdout.write(json.dumps(rows) + "\n")
        elif not rows:
            print_note(f"no models in the Hugging Face cache ({hub.display_path(hub.hf_cache_dir())}); "
                  "download one with `mlxspec pull MODEL`")
        else:
            _list_table(rows)


@app.command(name="rm")
def remove_model(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", show_default=False, autocompletion=complete_model,
        help="Cached repo id or catalog alias.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Remove MODEL (every cached revision) from the Hugging Face cache."""
    with user_errors():
        from ..hub import plan_removal
        from ..units import human_bytes

        plan = plan_removal(model)
        if not yes:
            if not sys.stdin.isatty():
                raise UsageError(f"removing {plan.repo_id} needs confirmation: pass --yes")
            if not typer.confirm(f"remove {plan.repo_id} ({human_bytes(plan.freed_bytes)})?", default=False):
                raise typer.Exit(1)
        plan.execute()
        sys.stdout.write(f"removed {plan.repo_id}, freed {human_bytes(plan.freed_bytes)}\n")
        sys.stdout.flush()


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
            caps = presets.model_caps(model, draft_model)
            chosen, reasons = presets.choose(prof, caps)
            data["auto"] = {"model": caps.name, "model_bytes": caps.model_bytes,
                            "has_mtp_head": caps.has_mtp_head, "draft_model": caps.draft_name,
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
