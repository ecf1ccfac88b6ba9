"""How ``mlxspec tune`` shows a result: tables of the costs and of each drafter's acceptance
and chosen depth, then a bar chart of the expected speed per depth."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..ui import bar


def cost_table(result: dict) -> Table:
    """The verify cost of each width over a short context, and over the long ones it was also
    timed at (a column each, "-" for a width not timed there), in one unit: a 1-token forward
    over the short context; then a pipelined plain token in that unit."""
    grown = result.get("verify_cost_context") or {}
    at, plain_at = grown.get("at") or {}, grown.get("plain_at") or {}
    costs = Table(title="verify cost (relative to 1 token)", title_justify="left")
    costs.add_column("tokens", justify="right")
    costs.add_column("cost", justify="right")
    for length in at:
        costs.add_column(f"over {int(length) // 1024}K", justify="right")

    def cell(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    for n, c in result["verify_cost"].items():
        costs.add_row(n, cell(c), *(cell(curve.get(n)) for curve in at.values()))
    if "plain_step" in result:
        costs.add_row("plain token", cell(result["plain_step"]), *(cell(plain_at.get(length)) for length in at))
    return costs


def drafter_table(result: dict) -> Table:
    summary = Table(title="drafters", title_justify="left")
    for col in ("drafter", "draft cost", "accept/position (1..8)", "depth", "speed vs plain"):
        summary.add_column(col, justify="left" if col.startswith(("drafter", "accept")) else "right")
    for name, d in result["depth"].items():
        rates = result["acceptance"][name]["all"]["rates"]
        shown = " ".join("-" if r is None else f"{r:.2f}" for r in rates)
        summary.add_row(name, f"{result['draft_cost'][name]:.3f}", shown,
                        "-" if d["depth"] is None else str(d["depth"]),
                        "-" if d["speedup"] is None else f"{d['speedup']:.2f}x")
    return summary


def print_depth_chart(result: dict, console: Console) -> None:
    """Per drafter, a bar of the expected tok/s at each depth (plain decoding = 1.00)."""
    for name, d in result["depth"].items():
        speedups = {int(k): v for k, v in d["speedups"].items()}
        if not speedups:
            console.print(f"[bold]{name}[/bold]: {d.get('note', 'no data')}")
            continue
        top = max(max(speedups.values()), 1.0)
        console.print(f"[bold]{name}[/bold]: relative tok/s by depth (plain = 1.00)")
        for k, s in speedups.items():
            mark = " ◀" if k == d["depth"] else ""
            console.print(f"  {k:>2} {s:5.2f} {bar(s, top)}{mark}", highlight=False)


def with_conclusion(result: dict) -> dict:
    """RESULT with ``conclusion``: what it means for `mlxspec run`, in words (``--json``)."""
    from ..tuning.choice import conclusion

    return {**result, "conclusion": conclusion(result)}


def render_tune_result(result: dict, console: Console, chart: bool = True) -> None:
    """Rich tables of a tune result, (with ``chart``) its bar chart of tok/s per depth, then
    its conclusion in words."""
    from rich.markup import escape

    from ..tuning.choice import conclusion

    console.print(cost_table(result))
    console.print(drafter_table(result))
    if chart:
        print_depth_chart(result, console)
    console.print(f"[bold]conclusion[/bold]: {escape(conclusion(result))}")
