"""Terminal rendering for the CLI: a streamed answer with a live status line, and stats."""

from __future__ import annotations

import time

from rich.cells import cell_len
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .engine.stats import Stats


def status_text(stats: Stats | None, prefill: tuple[int, int] | None = None, status: str | None = None) -> Text:
    """One line: speed, acceptance, drafter, depth and whether the gate has speculation on;
    before the first token, the step under way (STATUS, e.g. measuring costs) or how much of
    the prompt is prefilled."""
    if stats is None or stats.generated_tokens == 0:
        if status and not prefill:
            return Text(f"{status}…", style="dim", no_wrap=True, overflow="ellipsis")
        if prefill and prefill[1]:
            done, total = prefill
            return Text(f"prefilling {done}/{total} prompt tokens ({done / total:.0%})…", style="dim", no_wrap=True)
        return Text("prefilling…", style="dim", no_wrap=True)
    parts = [f"{stats.generated_tokens} tok", f"{stats.decode_tps:.1f} tok/s"]
    if stats.drafter != "none":
        parts += [f"accept {stats.acceptance:.0%}", f"{stats.drafter} depth {stats.depth}",
                  "spec on" if stats.speculating else "spec off"]
    else:
        parts.append("no drafter")
    return Text(" · ".join(parts), style="dim", no_wrap=True, overflow="ellipsis")  # always one row


BAR_EIGHTHS = " ▏▎▍▌▋▊▉█"  # a cell filled 0/8 .. 8/8 from the left


def bar(value: float, top: float, width: int = 24) -> str:
    """A Unicode bar of ``value`` on a scale where ``top`` fills ``width`` cells."""
    if top <= 0 or value <= 0:
        return ""
    eighths = round(min(value / top, 1.0) * width * 8)
    return "█" * (eighths // 8) + (BAR_EIGHTHS[eighths % 8] if eighths % 8 else "")


def stats_line(stats: Stats) -> str:
    """A short one-line summary (piped output, chat turns)."""
    parts = [
        f"{stats.generated_tokens} tokens",
        f"{stats.decode_tps:.1f} tok/s",
        f"prompt {stats.prompt_tokens} tok at {stats.prompt_tps:.1f} tok/s"
        + (f" ({stats.cached_tokens} reused)" if stats.cached_tokens else ""),
        f"ttft {stats.ttft_s:.2f}s",
    ]
    off = speculation_off(stats)
    if off:
        parts.append(off)
    elif stats.drafter == "none":
        parts.append("drafter none")
    else:
        parts.append(f"{stats.drafter} depth {stats.depth}")
        parts.append(f"accepted {stats.accepted}/{stats.drafted} ({stats.acceptance:.0%})")
        if stats.tree_steps:
            parts.append(f"{stats.tree_steps} trees of {stats.tree_nodes / stats.tree_steps:.1f} nodes")
    return " · ".join(parts)


def speculation_off(stats: Stats) -> str | None:
    """"speculation off (reason)" when nothing was drafted because a gate kept speculation off
    (or the model cannot roll back), else None."""
    if stats.drafted or not stats.gate_events or stats.gate_events[-1].enabled:
        return None
    return f"speculation off ({stats.gate_events[-1].reason})"


def stats_table(stats: Stats) -> Table:
    table = Table(title="mlxspec stats", show_header=False, title_style="bold", box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    rows = [
        ("tokens", f"{stats.prompt_tokens} prompt"
                   + (f" ({stats.cached_tokens} reused from an earlier prompt)" if stats.cached_tokens else "")
                   + f", {stats.generated_tokens} generated"),
        ("decode", f"{stats.decode_tps:.1f} tok/s"),
        ("prefill", f"{stats.prompt_tps:.1f} tok/s"),
        ("first token", f"{stats.ttft_s:.3f} s"),
        ("drafter", f"{stats.drafter} (depth {stats.depth})"),
    ]
    off = speculation_off(stats)
    if off:  # nothing was drafted: no acceptance to show, only why
        rows.append(("speculation", off.removeprefix("speculation ")))
    elif stats.drafter != "none":
        rows += [
            ("accepted", f"{stats.accepted}/{stats.drafted} drafted tokens ({stats.acceptance:.1%})"),
            ("tokens per verify", f"{stats.mean_accepted_length:.2f}"),
            ("forwards", f"{stats.verify_steps} verify, {stats.plain_steps} plain"),
        ]
        if stats.gate_events:
            last = stats.gate_events[-1]
            rows.append(("gate", f"{len(stats.gate_events)} switches, last: "
                                 f"{'on' if last.enabled else 'off'} ({last.reason})"))
    if stats.finish_reason:
        rows.append(("finish", stats.finish_reason))
    for name, value in rows:
        table.add_row(name, value)
    return table


class StreamView:
    """Streams text (optionally styled: reasoning is dim) to a terminal with a transient
    status line under it.

    Rich's Live can only redraw whole lines below the text, so finished lines are printed
    above the live region and the unfinished line is drawn inside it, with the status. The
    unfinished line is cut at a space once it is wider than the terminal, which keeps the
    live region two rows high (a region taller than the screen cannot be redrawn cleanly).
    """

    def __init__(self, console: Console, min_refresh_s: float = 0.05):
        self.console = console
        self.partial = Text()  # styled: reasoning is dimmed
        self.stats: Stats | None = None
        self.prefilled: tuple[int, int] | None = None  # (done, total) prompt tokens
        self.step: str | None = None  # a slow step before the first token (SpecModel.stream's on_status)
        self.min_refresh_s = min_refresh_s
        self._last_refresh = 0.0
        self.live = Live(console=console, transient=True, auto_refresh=False,
                         redirect_stdout=False, redirect_stderr=False)

    def __enter__(self) -> "StreamView":
        self.live.start()
        self._refresh(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, text: str, stats: Stats | None, style: str | None = None) -> None:
        self.stats = stats
        self.partial.append(text, style=style)
        if "\n" in self.partial.plain:
            *done, self.partial = self.partial.split("\n", allow_blank=True)
            for line in done:
                self.console.print(line)
        width = max(self.console.width, 10)
        while cell_len(self.partial.plain) > width:
            head, self.partial = _cut(self.partial, width)
            self.console.print(head)
        self._refresh()

    def status(self, label: str) -> None:
        """A step before the first token begins (SpecModel.stream's on_status): named in the status line."""
        self.step = label
        self._refresh(force=True)

    def prefill(self, done: int, total: int) -> None:
        """Progress of the prompt's prefill (SpecModel.stream's on_prefill)."""
        self.prefilled = (done, total)
        self._refresh(force=done >= total)

    def _refresh(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last_refresh >= self.min_refresh_s:
            self._last_refresh = now
            self.live.update(Group(self.partial.copy(), status_text(self.stats, self.prefilled, self.step)),
                             refresh=True)

    def close(self) -> None:
        """Remove the status line and leave the text, ending with a newline."""
        if not self.live.is_started:
            return
        self.live.stop()
        if self.partial.plain:
            self.console.print(self.partial)
            self.partial = Text()


def _cut(line: Text, width: int) -> tuple[Text, Text]:
    """Split LINE into a head at most WIDTH cells wide (at the last space if any) and the rest."""
    plain = line.plain
    end = min(len(plain), width)
    while end > 1 and cell_len(plain[:end]) > width:
        end -= 1
    space = plain.rfind(" ", 0, end + 1)
    if space > 0:
        return line[:space], line[space + 1:]
    return line[:end], line[end:]
