"""``mlxspec bench --real-shapes SHAPES --sharded``: bench/real_sharded.py from the command line,
under ``mlx.launch`` (every rank runs it; rank 0 alone prints and writes) or on one device."""

from __future__ import annotations

from ..errors import UsageError
from .bench_options import check_bits
from .console import print_note, progress, stdout_console


def run_sharded_cli(names: str | None, others, *, bits: int, workloads, prompt_tokens: int, max_tokens: int | None,
                    reps: int | None, seed: int, outputs) -> None:
    """NAMES: --real-shapes; OTHERS: (MODEL, --draft-model, --sweep), none of which may be given;
    OUTPUTS: (json path, png path). Default --max-tokens 128, --reps 8."""
    if names is None or any(v is not None for v in others):
        raise UsageError("--sharded runs with --real-shapes (its own random models): give no MODEL, "
                         "--draft-model or --sweep")
    check_bits(bits)
    from ..bench.prompts import parse_list
    from ..bench.real_plan import parse_shapes
    from ..bench.real_sharded import WORKLOADS, run_sharded
    from ..bench.report import real_shapes_document, render, write_json
    from ..models.sharding import world

    json_path, png_path = outputs
    if png_path:
        raise UsageError("--sharded writes no chart: give --json and redraw it with --from-json --png")
    shapes = parse_shapes(names)
    chosen = parse_list(workloads, "workloads") or list(WORKLOADS)
    group = world()  # None: not launched (or a group of one): this device alone
    first = group is None or group.rank() == 0

    def save(result):  # the repetitions done survive a run stopped later
        if json_path and first:
            write_json(real_shapes_document(result), json_path)

    with progress("sharded real shapes") as on_step:
        result = run_sharded(shapes, group, bits=bits, prompt_tokens=prompt_tokens, max_tokens=max_tokens or 128,
                             reps=reps or 8, workloads=chosen, seed=seed, on_step=on_step, on_partial=save)
    if not first:
        return
    doc = real_shapes_document(result)
    render(doc, stdout_console())
    if json_path:
        write_json(doc, json_path)
        print_note(f"wrote {json_path}")
    if not all(c["identical"] for c in result["cells"]):
        print_note("note: some cell's tokens differ from the script (column identical)")
    if not result["baseline_stock"]:
        print_note("note: the baseline's evidence does not say stock mlx-lm (baseline_failures in the JSON)")
