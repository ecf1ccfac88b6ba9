"""``mlxspec run``'s output: one streamed answer (reasoning apart from the answer), and the
interactive chat."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

from ..errors import MlxspecError
from .console import print_error, print_note, print_stats, stdout_console


def starts_in_reasoning(spec, prompt, request) -> bool:
    """Whether the model's text starts inside ``<think>`` (the prompt opened it, as Qwen3.5/3.6's
    templates do when thinking is on); REQUEST (a GenerationRequest) says how the prompt renders."""
    from ..reasoning import starts_in_reasoning as tail_opens

    ids = spec.encode(prompt, system=request.system, raw=request.raw, tools=request.tools,
                      template_kwargs=request.template_kwargs)
    return tail_opens(spec.tokenizer, ids)


class Answer:
    """Streams one answer to stdout (live status on a terminal, plain text when piped).

    Reasoning comes before the answer: dimmed on a terminal, as the model wrote it (its
    ``<think>`` tags included) when piped, not at all with HIDE_REASONING. ``text`` is the
    answer alone, ``reasoning`` the reasoning alone."""

    def __init__(self, live: bool, hide_reasoning: bool = False):
        self.live = live
        self.hide = hide_reasoning
        self.text = ""
        self.reasoning = ""
        self.stats = None
        self.interrupted = False
        self._styled = live or stdout_console().is_terminal
        self._shown = None  # kind of the last piece shown on a terminal
        self._open_tag = False  # piped: "<think>\n" still to print before the model's text
        self._tail = ""  # last character printed without the live view

    def stream(self, spec, prompt, request) -> "Answer":
        """Stream SPEC's answer to PROMPT as REQUEST (a GenerationRequest) asks."""
        from ..reasoning import ReasoningSplitter
        from ..ui import StreamView

        in_reasoning = starts_in_reasoning(spec, prompt, request)
        splitter = ReasoningSplitter(in_reasoning)
        self._open_tag = in_reasoning and not self.hide  # the prompt wrote it; piped text shows it
        view = StreamView(stdout_console()) if self.live else None
        if view:  # a long prompt's prefill shows its progress in the status line
            request = replace(request, on_prefill=view.prefill)
        chunks = spec.stream(prompt, request=request)
        try:
            with view if view else contextlib.nullcontext():
                try:
                    for chunk in chunks:
                        self.stats = chunk.stats
                        self._show(splitter.feed(chunk.text), chunk.text, view)
                except KeyboardInterrupt:
                    self.interrupted = True
                self._show(splitter.finish(), "", view)
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            chunks.close()  # stops the engine if the loop ended early
        if not view and self._tail not in ("", "\n"):
            self._print("\n", None, None) if self._styled else self._write("\n")
        return self

    def _show(self, pieces: list[tuple[str, str]], raw: str, view) -> None:
        for kind, piece in pieces:
            if kind == "content":
                self.text += piece
            else:
                self.reasoning += piece
        if not self._styled:  # piped: the text as written, or the answer alone
            if self.hide:
                self._write("".join(piece for kind, piece in pieces if kind == "content"))
            elif raw:
                self._write(("<think>\n" if self._open_tag else "") + raw)
                self._open_tag = False
            return
        for kind, piece in pieces:
            if kind == "reasoning" and self.hide:
                continue
            if self._shown not in (None, kind):  # a blank line between reasoning and answer
                self._print("\n\n", None, view)
            self._shown = kind
            self._print(piece, "dim" if kind == "reasoning" else None, view)
        if view:
            view.write("", self.stats)  # the status line moves on even while nothing is shown

    def _print(self, text: str, style: str | None, view) -> None:
        if view:
            view.write(text, self.stats, style)
            return
        from rich.text import Text

        stdout_console().print(Text(text, style=style or ""), end="", soft_wrap=True)
        self._tail = text[-1:] or self._tail

    def _write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self._tail = text[-1]


CHAT_HELP = "commands: /reset (forget the conversation), /stats (last answer's stats), /exit (or Ctrl-D)"


def chat(spec, request, show_stats: bool, live: bool, hide_reasoning: bool = False) -> None:
    """Interactive chat: history kept across turns, Ctrl-C stops an answer, Ctrl-D quits; every
    answer as REQUEST (a GenerationRequest) asks."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  line editing and history for input()

    print_note(f"chatting with {spec.name}; {CHAT_HELP}")
    history: list[dict] = []
    last_stats = None
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print_note("")
            return
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit", "/bye"):
            return
        if command == "/reset":
            history.clear()
            print_note("conversation cleared")
            continue
        if command == "/stats":
            if last_stats is None:
                print_note("no answer yet")
            else:
                print_stats(last_stats, table=True)
            continue
        if command.startswith("/"):
            print_note(f"unknown command {command.split()[0]}; {CHAT_HELP}")
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = Answer(live, hide_reasoning).stream(spec, list(history), request)
        except MlxspecError as err:
            history.pop()
            print_error(str(err))
            continue
        if answer.interrupted:
            print_note("[stopped]")
        # a stopped answer stays in the history: it is what the user saw. Only the answer:
        # chat templates drop past turns' reasoning anyway
        history.append({"role": "assistant", "content": answer.text})
        last_stats = answer.stats or last_stats
        if show_stats:
            print_stats(answer.stats, table=False)
