"""How the chat reads a message on a terminal: a paste of many lines is one message.

Terminals mark a paste when asked to (bracketed paste: ``ESC[?2004h`` turns it on, the paste
then comes between ``ESC[200~`` and ``ESC[201~``), as Ollama's chat reads it. GNU readline
(Linux's Python) does this itself once ``enable-bracketed-paste`` is on (Python turns it off):
``input()`` then returns the pasted lines as one string. Where there is no GNU readline
(macOS's libedit, a Python without the readline module), :class:`LineReader` reads the
terminal itself: line editing (arrows, Home/End, Ctrl-A/E/B/F/U/K/W/L, history with Up/Down)
and bracketed paste, on while it reads and off again before it returns."""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import sys

PASTE_ON, PASTE_OFF = "\x1b[?2004h", "\x1b[?2004l"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
CONTINUATION = "... "  # before each line after the first of a message, as for \"\"\"
# an escape sequence: CSI (ESC [ params final), SS3 (ESC O x) or Alt-x (ESC x)
ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[~A-Za-z]|O[A-Za-z]|[^\[O])")
ESCAPE_PREFIX = re.compile(r"\x1b(\[[0-9;?]*|O)?\Z")  # the start of one, cut at the end of a read


def readline_pastes() -> bool:
    """Whether input() reads with GNU readline and it now takes a paste as one string
    (enable-bracketed-paste turned back on); False for libedit or no readline."""
    try:
        import readline
    except ImportError:
        return False
    if getattr(readline, "backend", "readline") != "readline" or "libedit" in (readline.__doc__ or ""):
        return False
    if getattr(readline, "_READLINE_RUNTIME_VERSION", 0) < 0x0700:  # bracketed paste: readline 7.0
        return False
    readline.parse_and_bind("set enable-bracketed-paste on")
    return True


def flush_input(stream=None) -> None:
    """Drop what was typed or pasted ahead on the terminal (a Ctrl-C stopped the answer it was
    queued behind: it must not become the next message)."""
    stream = stream or sys.stdin
    with contextlib.suppress(Exception):
        import termios

        if stream.isatty():
            termios.tcflush(stream.fileno(), termios.TCIFLUSH)


def _shown(ch: str) -> str:
    """How CH is drawn: a tab as spaces, other control characters as ^X, text that is not
    UTF-8 (surrogates) as U+FFFD."""
    if ch == "\t":
        return "    "
    if ch < " " or ch == "\x7f":
        return "^" + chr(ord(ch) ^ 0x40)
    if "\ud800" <= ch <= "\udfff":
        return "\ufffd"
    return ch


class LineReader:
    """Reads one message from a terminal in raw mode: Enter sends it, a paste (newlines
    included) is inserted whole, Ctrl-C raises KeyboardInterrupt, Ctrl-D on an empty line
    raises EOFError. FD_IN is the terminal, OUT the text stream it is drawn on."""

    def __init__(self, fd_in: int | None = None, out=None):
        self.fd = sys.stdin.fileno() if fd_in is None else fd_in
        self.out = out or sys.stdout
        self.history: list[str] = []

    # -- terminal ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _raw(self):
        import termios

        saved = termios.tcgetattr(self.fd)
        mode = termios.tcgetattr(self.fd)
        mode[0] &= ~(termios.ICRNL | termios.INLCR | termios.IXON)  # Enter as \r; Ctrl-S/Q as keys
        mode[3] &= ~(termios.ICANON | termios.ECHO | termios.ISIG | termios.IEXTEN)  # Ctrl-C as a key
        mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
        termios.tcsetattr(self.fd, termios.TCSADRAIN, mode)
        self._write(PASTE_ON)
        try:
            yield
        finally:
            self._write(PASTE_OFF)
            termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _width(self) -> int:
        try:
            return max(os.get_terminal_size(self.fd).columns, 10)
        except OSError:
            return 80

    # -- reading ----------------------------------------------------------------------------

    def read(self, prompt: str = "") -> str:
        self.prompt, self.buffer, self.cursor = prompt, "", 0
        self.pasting, self.row = False, 0  # row: the cursor's row below the prompt's
        self.browse = len(self.history)  # the history entry shown (len: the new line)
        self.draft = ""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        pending = ""
        with self._raw():
            self._render()
            while True:
                data = os.read(self.fd, 65536)
                if not data:
                    raise EOFError
                pending = self._keys(pending + decoder.decode(data))
                if pending is None:  # Enter
                    self._render(len(self.buffer))
                    self._write("\r\n")
                    if self.buffer.strip() and (not self.history or self.history[-1] != self.buffer):
                        self.history.append(self.buffer)
                    return self.buffer
                self._render()

    def _keys(self, text: str) -> str | None:
        """Apply the keys in TEXT; -> what is left for the next read (a sequence cut short), or
        None when Enter was pressed."""
        i = 0
        while i < len(text):
            if self.pasting:
                end = text.find(PASTE_END, i)
                if end < 0:  # the paste goes on: keep a marker cut at the end for the next read
                    keep = next((n for n in range(len(PASTE_END) - 1, 0, -1)
                                 if text.endswith(PASTE_END[:n])), 0)
                    self._insert(_pasted(text[i:len(text) - keep]))
                    return text[len(text) - keep:]
                self._insert(_pasted(text[i:end]))
                self.pasting, i = False, end + len(PASTE_END)
                continue
            ch = text[i]
            if ch == "\x1b":
                match = ESCAPE.match(text, i)
                if match is None:
                    if ESCAPE_PREFIX.match(text, i):
                        return text[i:]
                    i += 1
                    continue
                self._escape(match.group(0))
                i = match.end()
                continue
            i += 1
            if ch in "\r\n":
                return None
            self._key(ch)
        return ""

    def _key(self, ch: str) -> None:
        b, c = self.buffer, self.cursor
        if ch == "\x03":  # Ctrl-C
            self._render(len(b))
            raise KeyboardInterrupt
        if ch == "\x04":  # Ctrl-D: quits on an empty line, else deletes
            if not b:
                raise EOFError
            self.buffer = b[:c] + b[c + 1:]
        elif ch in "\x7f\x08":  # Backspace
            if c:
                self.buffer, self.cursor = b[:c - 1] + b[c:], c - 1
        elif ch == "\x01":
            self.cursor = b.rfind("\n", 0, c) + 1
        elif ch == "\x05":
            end = b.find("\n", c)
            self.cursor = len(b) if end < 0 else end
        elif ch == "\x02":
            self.cursor = max(c - 1, 0)
        elif ch == "\x06":
            self.cursor = min(c + 1, len(b))
        elif ch == "\x15":  # Ctrl-U: the line before the cursor
            start = b.rfind("\n", 0, c) + 1
            self.buffer, self.cursor = b[:start] + b[c:], start
        elif ch == "\x0b":  # Ctrl-K: the line after the cursor
            end = b.find("\n", c)
            self.buffer = b[:c] + (b[end:] if end >= 0 else "")
        elif ch == "\x17":  # Ctrl-W: the word before the cursor
            start = len(b[:c].rstrip())
            start = max(b.rfind(" ", 0, start), b.rfind("\n", 0, start)) + 1
            self.buffer, self.cursor = b[:start] + b[c:], start
        elif ch == "\x0c":  # Ctrl-L: clear the screen
            self._write("\x1b[H\x1b[2J")
            self.row = 0
        elif ch == "\x10":
            self._browse(-1)
        elif ch == "\x0e":
            self._browse(1)
        elif ch == "\t":
            self._insert("    ")
        elif ch >= " ":
            self._insert(ch)

    def _escape(self, seq: str) -> None:
        if seq == PASTE_START:
            self.pasting = True
            return
        final, params = seq[-1], seq[2:-1]
        keys = {"A": "\x10", "B": "\x0e", "C": "\x06", "D": "\x02", "H": "\x01", "F": "\x05"}
        tilde = {"1": "\x01", "7": "\x01", "4": "\x05", "8": "\x05"}
        if seq in ("\x1bb", "\x1b[1;5D", "\x1b[1;3D"):  # a word left
            start = len(self.buffer[:self.cursor].rstrip())
            self.cursor = self.buffer.rfind(" ", 0, start) + 1
        elif seq in ("\x1bf", "\x1b[1;5C", "\x1b[1;3C"):  # a word right
            rest = self.buffer[self.cursor:]
            skip = len(rest) - len(rest.lstrip())
            end = self.buffer.find(" ", self.cursor + skip)
            self.cursor = len(self.buffer) if end < 0 else end
        elif seq[1] in "[O" and final in keys and not params:
            self._key(keys[final])
        elif final == "~" and params in tilde:
            self._key(tilde[params])
        elif final == "~" and params == "3":  # Delete
            self.buffer = self.buffer[:self.cursor] + self.buffer[self.cursor + 1:]

    def _insert(self, text: str) -> None:
        self.buffer = self.buffer[:self.cursor] + text + self.buffer[self.cursor:]
        self.cursor += len(text)

    def _browse(self, step: int) -> None:
        target = self.browse + step
        if not 0 <= target <= len(self.history):
            return
        if self.browse == len(self.history):
            self.draft = self.buffer
        self.browse = target
        self.buffer = self.history[target] if target < len(self.history) else self.draft
        self.cursor = len(self.buffer)

    # -- drawing ----------------------------------------------------------------------------

    def _place(self, text: str, width: int) -> tuple[int, int]:
        """(row, column) after drawing the prompt and TEXT (a continuation mark after each
        newline), wrapping at WIDTH as a terminal does."""
        from rich.cells import cell_len

        row = col = 0
        for ch in self.prompt + text:  # (the prompt has no newline)
            if ch == "\n":
                row, col = row + 1, len(CONTINUATION)
                continue
            w = cell_len(_shown(ch))
            if col + w > width:
                row, col = row + 1, 0
            col += w
        return row, col

    def _render(self, cursor: int | None = None) -> None:
        """Redraw the message from its first row, the cursor at CURSOR (default: the
        cursor's place in the text)."""
        cursor = self.cursor if cursor is None else cursor
        width = self._width()
        shown = "".join("\r\n" + CONTINUATION if ch == "\n" else _shown(ch) for ch in self.buffer)
        up = f"\x1b[{self.row}A" if self.row else ""
        end_row, end_col = self._place(self.buffer, width)
        tail = ""
        if end_col >= width:  # the terminal waits to wrap: go to the next row now
            tail, end_row, end_col = "\r\n", end_row + 1, 0
        row, col = self._place(self.buffer[:cursor], width)
        if col >= width:
            row, col = row + 1, 0
        move = (f"\x1b[{end_row - row}A" if end_row > row else "") + "\r" + (f"\x1b[{col}C" if col else "")
        self._write(f"{up}\r\x1b[J{self.prompt}{shown}{tail}{move}")
        self.row = row


def _pasted(text: str) -> str:
    """A paste's line ends as newlines (terminals send \\r for them)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")
