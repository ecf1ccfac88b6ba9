"""``mlxspec run``'s output: one streamed answer (reasoning apart from the answer), and the
interactive chat."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

from ..errors import MlxspecError
from .console import print_error, print_note, print_stats, replaced_note, stdout_console, valid_text
from .lineread import PASTE_OFF, LineReader, flush_input, readline_pastes


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
        if view:  # a long prompt's prefill, or a step before it, shows in the status line
            request = replace(request, on_prefill=view.prefill, on_status=view.status)
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


CHAT_HELP = "/help lists the commands; /exit or Ctrl-D quits"
CHAT_COMMANDS = """commands:
  /help            this list
  /reset, /clear   forget the conversation
  /stats           the last answer's stats
  /exit, /bye      quit (or Ctrl-D; Ctrl-C twice at an empty prompt)
  \"\"\"              start a multi-line message; end it with \"\"\"
A paste of many lines is one message. Ctrl-C stops an answer.
A conversation longer than the model's context drops its oldest turns."""


def read_message(ask=None) -> str:
    """One message from the user: a line, a paste of many lines (bracketed paste: see
    :mod:`.lineread`), or the lines between \"\"\" and \"\"\" (ollama's multi-line input);
    text that was not UTF-8 replaced, with a note."""
    ask = ask or input  # looked up now: a test may replace it
    line = ask(">>> ")
    if "\n" in line:  # a paste: one message as it is, even if it starts with \"\"\"
        line = line.strip("\r\n")
    elif line.lstrip().startswith('"""'):
        text = line.lstrip()[3:]
        lines = []
        while not text.rstrip().endswith('"""'):
            lines.append(text)
            text = ask("... ")
        lines.append(text.rstrip()[:-3])
        line = "\n".join(lines).strip("\n")
    line, replaced = valid_text(line)
    if replaced:
        print_note(replaced_note("that message"))
    return line


def fit_context(spec, history: list[dict], request) -> int:
    """Drop the oldest exchanges (a user message and its answer) until the conversation leaves
    room for an answer in the model's context; returns how many were dropped. A last message
    too long on its own is left to the API, which refuses it."""
    limit = getattr(getattr(spec, "target", None), "context_length", None)
    if not limit:
        return 0

    def tokens(messages) -> int:
        return len(spec.encode(messages, system=request.system, raw=request.raw, tools=request.tools,
                               template_kwargs=request.template_kwargs))

    room = max(1, min(request.max_tokens, limit // 4))
    if tokens(history[-1:]) + room > limit:
        return 0
    dropped = 0
    while len(history) > 2 and tokens(history) + room > limit:
        del history[:2]
        dropped += 1
    return dropped


class ChatState:
    """What the chat keeps between turns."""

    def __init__(self):
        self.history: list[dict] = []
        self.last_stats = None
        self.interrupted = False  # Ctrl-C at the prompt once: a second one quits


def _command(command: str, state: ChatState) -> bool:
    """Run a /command; False when it asks to quit."""
    name = command.split()[0]
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name in ("/reset", "/clear"):
        state.history.clear()
        print_note("conversation cleared")
    elif name in ("/help", "/?"):
        print_note(CHAT_COMMANDS)
    elif name == "/stats":
        if state.last_stats is None:
            print_note("no answer yet")
        else:
            print_stats(state.last_stats, table=True)
    else:
        print_note(f"unknown command {name}; {CHAT_HELP}")
    return True


def _turn(spec, request, state: ChatState, line: str, live: bool, hide_reasoning: bool):
    """One exchange: the conversation fitted to the context, the answer streamed; its Answer,
    or None when the API refused the message."""
    state.history.append({"role": "user", "content": line})
    dropped = fit_context(spec, state.history, request)
    if dropped:
        print_note(f"note: the conversation outgrew {spec.name}'s context: dropped the oldest "
                   f"{dropped} exchange{'s' * (dropped != 1)} (/reset starts over)")
    try:
        answer = Answer(live, hide_reasoning).stream(spec, list(state.history), request)
    except MlxspecError as err:
        state.history.pop()
        print_error(str(err))
        return None
    if answer.interrupted:
        print_note("[stopped]")
        flush_input()  # what was typed or pasted meanwhile is not the next message
    # a stopped answer stays in the history: it is what the user saw. Only the answer:
    # chat templates drop past turns' reasoning anyway
    state.history.append({"role": "assistant", "content": answer.text})
    state.last_stats = answer.stats or state.last_stats
    return answer


def chat(spec, request, show_stats: bool, live: bool, hide_reasoning: bool = False) -> None:
    """Interactive chat: history kept across turns, Ctrl-C stops an answer (twice at the prompt:
    quits), Ctrl-D quits; every answer as REQUEST (a GenerationRequest) asks."""
    with contextlib.suppress(AttributeError, ValueError, OSError):  # bytes that are not UTF-8: replaced later
        sys.stdin.reconfigure(errors="surrogateescape")
    terminal = _isatty(sys.stdin) and _isatty(sys.stdout)
    ask = None  # input(): GNU readline's line editing, a paste as one message
    if terminal and not readline_pastes():  # libedit or no readline: read the terminal here
        ask = LineReader().read
    print_note(f"chatting with {spec.name}; {CHAT_HELP}")
    try:
        _chat(spec, request, show_stats, live, hide_reasoning, ask)
    finally:
        if terminal:  # bracketed paste is off after the chat, however it ended
            sys.stdout.write(PASTE_OFF)
            sys.stdout.flush()


def _isatty(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


def _chat(spec, request, show_stats: bool, live: bool, hide_reasoning: bool, ask) -> None:
    state = ChatState()
    while True:
        try:
            line = read_message(ask)
        except EOFError:
            print_note("")
            return
        except KeyboardInterrupt:
            print_note("")
            if state.interrupted:
                return
            state.interrupted = True
            print_note("(Ctrl-C again, Ctrl-D or /exit quits)")
            continue
        state.interrupted = False
        command = line.strip()
        if not command:
            continue
        if command.startswith("/") and "\n" not in command:
            if not _command(command, state):
                return
            continue
        try:
            answer = _turn(spec, request, state, line, live, hide_reasoning)
        except KeyboardInterrupt:  # before the answer began (fitting the context): not sent
            if state.history and state.history[-1]["role"] == "user":
                state.history.pop()
            print_note("\n[stopped]")
            flush_input()
            continue
        if answer is not None and show_stats:
            print_stats(answer.stats, table=False)
