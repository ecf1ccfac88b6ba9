"""Commands for the model cache and checkpoints: convert, pull, list, rm.

They register on the one Typer app of :mod:`mlxspec.cli`, which imports this module.
"""

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from .app import app
from .console import (
    complete_model,
    complete_removable,
    help_text,
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

HF_PATH may also be a GGUF file (llama.cpp, Ollama, LM Studio; or ollama:NAME[:TAG]): config,
tokenizer and chat template come from its metadata; Q4_0 / Q4_1 / Q8_0 tensors stay quantized
as they are, other quantized types are re-quantized to MLX 4- or 8-bit.
""")


def _convert_gguf(source: str, out: str, force: bool, status, dtype: Optional[str] = None) -> None:
    from ..models.gguf import convert_gguf
    from ..models.loader import gguf_source
    from ..units import human_bytes

    path = gguf_source(source)
    result = convert_gguf(path, out, force=force, dtype=dtype,
                          on_step=(lambda message: status.update(message + "…")) if status else None)
    for note in result.notes:
        print_note(note)
    types = ", ".join(f"{n} {t}" for t, n in sorted(result.types.items(), key=lambda kv: -kv[1]))
    size = sum(p.stat().st_size for p in result.out.rglob("*") if p.is_file())
    sys.stdout.write(f"converted {path.name} ({result.architecture}: {types}) to {result.out} "
                     f"({human_bytes(size)}, {result.kept_quantized} tensors kept quantized)\n")
    sys.stdout.flush()


def _is_gguf_ref(ref: str) -> bool:
    return ref.strip().lower().endswith(".gguf") or ref.strip().startswith(("ollama:", "lmstudio:"))


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
                        "(default: the checkpoint's own dtype, as mlx-lm picks it; a GGUF's "
                        "float16 beside quantized tensors). For a GGUF, quantization scales too.",
        show_default=False)] = None,
    mtp_bits: Annotated[Optional[int], typer.Option(
        "--mtp-bits", help="Bits for the MTP head's linear weights (default: as --q-bits); "
                           "0 keeps the head unquantized.", show_default=False)] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace OUT if it exists and is not empty.")] = False,
) -> None:
    with user_errors():
        from ..models.convert import DTYPES, convert_checkpoint
        from ..units import human_bytes

        console = stderr_console()
        status = console.status("starting…", spinner="dots") if console.is_terminal else None
        if _is_gguf_ref(hf_path):
            given = [flag for flag, value in (("--q-bits", q_bits), ("--mtp-bits", mtp_bits)) if value is not None]
            if given:
                raise UsageError(f"{given[0]} does not apply to a GGUF source: its quantization is kept")
            if dtype is not None and dtype not in DTYPES:
                raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
            with status if status else contextlib.nullcontext():
                _convert_gguf(hf_path, out, force, status, dtype)
            return
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


# -- the pull, list and rm commands (model cache) ------------------------------

PULL_HELP = help_text("""
Download MODEL into the Hugging Face cache, where `mlxspec run`, mlx-lm and other tools find it.

MODEL is a repo id (org/name) or a short alias from mlxspec's catalog (see `mlxspec list
--catalog`). Only the files a model needs are fetched: weights, config, tokenizer, chat template
and, unless --no-include-mtp, an MTP head sidecar. Files already cached are skipped, so running
the command again after an interruption finishes the download. HF_HOME, HF_HUB_CACHE, HF_TOKEN,
HF_ENDPOINT and HF_HUB_OFFLINE are honoured.

A drafter-only checkpoint (a DFlash drafter such as z-lab/Qwen3-8B-DFlash-b16, a Gemma-4
assistant: config and weights, no tokenizer) is pulled the same way; it drafts for its target
(--draft-model, or found beside the target by --drafter auto).
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
        _drafter_note(result.repo_id, result.config)


def _drafter_note(repo_id: str, config: dict) -> None:
    """How to use a drafter-only checkpoint just pulled (it is no model to run by itself)."""
    from ..hub import drafter_kind
    from ..presets import DRAFT_KINDS

    kind = drafter_kind(config)
    if kind is not None:
        print_note(f"note: {repo_id} is a {DRAFT_KINDS[kind]}, not a model: run its target with --draft-model "
                   f"{repo_id}, or let --drafter auto (or {kind}) find it beside the target")


def _list_table(rows: list) -> None:
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for column, justify in (("MODEL", "left"), ("SIZE", "right"), ("ARCH", "left"), ("QUANT", "left"),
                            ("MTP", "left"), ("CONTEXT", "right")):
        table.add_column(column, justify=justify, no_wrap=column != "MODEL")
    from ..presets import DRAFT_KINDS

    for row in rows:
        quant = row["quantization"]
        drafter = f" ({DRAFT_KINDS[row['drafter']]})" if row.get("drafter") else ""
        table.add_row(row["repo_id"], row["size"], (row["architecture"] or "?") + drafter,
                      f"{quant['bits']}-bit/g{quant['group_size']}" if quant else "-",
                      "yes" if row["mtp"] else "-",
                      f"{row['context_length']:,}" if isinstance(row["context_length"], int) else "?")
    stdout_console().print(table)


def _gguf_summary(path) -> tuple[str, str]:
    """(architecture, most common tensor type) from a GGUF header; "?" when unreadable."""
    from ..errors import MlxspecError
    from ..models.gguf_file import read_header

    try:
        header = read_header(path)
    except MlxspecError:
        return "?", "?"
    counts: dict = {}
    for info in header.tensors.values():
        if len(info.shape) == 2:
            counts[info.type_name] = counts.get(info.type_name, 0) + 1
    return header.architecture or "?", max(counts, key=counts.get) if counts else "?"


def _list_stores(ollama: bool, lmstudio: bool, json_out: bool) -> None:
    from ..models import stores
    from ..units import human_bytes

    found, empty = [], []
    for wanted, lister, where in ((ollama, stores.list_ollama, stores.ollama_dir),
                                  (lmstudio, stores.list_lmstudio, stores.lmstudio_dir)):
        if wanted:
            models = lister()
            found += models
            if not models:
                empty.append(str(where()))
    rows = []
    for model in found:
        arch, quant = _gguf_summary(model.path)
        rows.append({"model": model.ref, "size_bytes": model.size, "architecture": arch,
                     "quantization": quant, "path": str(model.path)})
    if json_out:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    for where in empty:
        print_note(f"no GGUF models in {where}")
    if rows:
        from rich.table import Table

        table = Table(show_edge=False, pad_edge=False)
        for column, justify in (("MODEL", "left"), ("SIZE", "right"), ("ARCH", "left"), ("QUANT", "left")):
            table.add_column(column, justify=justify, no_wrap=column != "MODEL")
        for row in rows:
            table.add_row(row["model"], human_bytes(row["size_bytes"]), row["architecture"], row["quantization"])
        stdout_console().print(table)
        print_note("run one with `mlxspec run MODEL` (converted once into mlxspec's cache; the store is not changed)")


def _conversion_rows() -> list[dict]:
    """The GGUF conversions in mlxspec's cache as list rows (kind "gguf"; repo_id None)."""
    from ..hub import describe
    from ..models.gguf_cache import list_conversions
    from ..units import human_bytes

    rows = []
    for conversion in list_conversions():
        try:
            config = json.loads((conversion.path / "config.json").read_text(encoding="utf-8"))
            config = config if isinstance(config, dict) else {}
        except (OSError, ValueError):
            config = {}
        size = conversion.size_bytes
        row = {"kind": "gguf", "repo_id": None, "name": conversion.name, "source": conversion.source,
               "sources": conversion.sources, "sha256": conversion.sha256,
               "converted": conversion.converted.isoformat() if conversion.converted else None,
               "size_bytes": size, "size": human_bytes(size), "path": str(conversion.path)}
        row.update(describe(conversion.path, config) if config else
                   {"architecture": None, "quantization": None, "mtp": False, "context_length": None,
                    "drafter": None})
        rows.append(row)
    return rows


def _conversions_table(rows: list) -> None:
    from rich.table import Table

    from ..hub import display_path
    from ..models.gguf_cache import gguf_cache_dir

    table = Table(show_edge=False, pad_edge=False, title_justify="left",
                  title=f"GGUF conversions ({display_path(gguf_cache_dir())})")
    for column, justify in (("NAME", "left"), ("SOURCE", "left"), ("SIZE", "right"), ("ARCH", "left"),
                            ("QUANT", "left"), ("CONVERTED", "left")):
        wraps = column in ("NAME", "SOURCE")  # folded where they must: both are long, both matter
        table.add_column(column, justify=justify, no_wrap=not wraps, overflow="fold" if wraps else "ellipsis",
                         min_width=24 if wraps else None)
    for row in rows:
        quant = row["quantization"]
        sources = row["sources"] or [row["source"] + " (path not recorded)"]
        shown = [display_path(Path(s)) if s.startswith("/") else s for s in sources]
        when = "?"
        if row["converted"]:
            from datetime import datetime

            when = datetime.fromisoformat(row["converted"]).astimezone().strftime("%Y-%m-%d %H:%M")
        table.add_row(row["name"], "\n".join(shown), row["size"], row["architecture"] or "?",
                      f"{quant['bits']}-bit/g{quant['group_size']}" if quant else "-", when)
    stdout_console().print(table)


LIST_HELP = help_text("""
List the models mlxspec can run without downloading: the Hugging Face cache (size,
architecture, drafters marked: a DFlash drafter, a Gemma-4 assistant; quantization, MTP head,
context), then the GGUF files converted into mlxspec's cache by `mlxspec run FILE.gguf` or
`mlxspec run ollama:NAME` (each with its sources: the file path or ollama:NAME:TAG, its size
and when it was converted; one conversion per file content, whatever the names it was run by).

--json prints one list of objects: Hugging Face models have "kind": "hf" and a "repo_id", GGUF
conversions "kind": "gguf", a "name" (what `mlxspec rm` takes), "source", "sources", "sha256"
and "converted". --ollama and --lmstudio list those stores instead.
""")


@app.command(name="list", help=LIST_HELP)
def list_models(
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list of objects.")] = False,
    show_catalog: Annotated[bool, typer.Option(
        "--catalog", help="List the aliases `mlxspec pull` knows instead of the cached models.")] = False,
    ollama: Annotated[bool, typer.Option(
        "--ollama", help="List the GGUF models in Ollama's store ($OLLAMA_MODELS or ~/.ollama/models).")] = False,
    lmstudio: Annotated[bool, typer.Option(
        "--lmstudio", help="List the GGUF models in LM Studio's store (~/.lmstudio/models).")] = False,
) -> None:
    with user_errors():
        from .. import hub

        if ollama or lmstudio:
            _list_stores(ollama, lmstudio, json_out)
            return
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
        rows = [{"kind": "hf", **row} for row in hub.list_models()]
        conversions = _conversion_rows()
        if json_out:
            sys.stdout.write(json.dumps(rows + conversions) + "\n")
            return
        if rows:
            _list_table(rows)
        elif not conversions:
            print_note(f"no models in the Hugging Face cache ({hub.display_path(hub.hf_cache_dir())}); "
                       "download one with `mlxspec pull MODEL`, or run a GGUF file with `mlxspec run FILE.gguf`")
        if conversions:
            if rows:
                stdout_console().print()
            _conversions_table(conversions)


RM_HELP = help_text("""
Remove MODEL from the cache it is in and say how much space that freed.

A repo id or catalog alias removes every cached revision from the Hugging Face cache. A GGUF
conversion in mlxspec's cache is removed by the name `mlxspec list` shows, by its GGUF file's
path (the file itself is never touched) or by its ollama:NAME[:TAG] name (Ollama's store is not
touched either); the next `mlxspec run` of that GGUF converts it again.
""")


@app.command(name="rm", help=RM_HELP)
def remove_model(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", show_default=False, autocompletion=complete_removable,
        help="Cached repo id or catalog alias; or a GGUF conversion: its listed name, GGUF file path "
             "or ollama:NAME[:TAG].")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    with user_errors():
        from ..units import human_bytes

        label, freed, execute = _removal(model)
        if not yes:
            if not sys.stdin.isatty():
                raise UsageError(f"removing {label} needs confirmation: pass --yes")
            if not typer.confirm(f"remove {label} ({human_bytes(freed)})?", default=False):
                raise typer.Exit(1)
        execute()
        sys.stdout.write(f"removed {label}, freed {human_bytes(freed)}\n")
        sys.stdout.flush()


def _removal(model: str):
    """(what is removed, in words; bytes freed; the function that removes it) for MODEL."""
    from ..errors import ModelNotFoundError
    from ..hub import display_path, plan_removal
    from ..models.gguf_cache import find_conversion, gguf_cache_dir, remove_conversion

    conversion = find_conversion(model)
    if conversion is not None:
        label = f"the GGUF conversion {conversion.name} (of {conversion.source})"
        return label, conversion.size_bytes, lambda: remove_conversion(conversion)
    if _is_gguf_ref(model):
        raise ModelNotFoundError(f"no conversion of '{model.strip()}' in mlxspec's GGUF cache "
                                 f"({display_path(gguf_cache_dir())}); see `mlxspec list`")
    plan = plan_removal(model)
    return plan.repo_id, plan.freed_bytes, plan.execute
