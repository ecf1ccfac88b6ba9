"""The chat on a terminal (issue 33, section 2): a paste of many lines is one message
(bracketed paste, as Ollama reads it), with GNU readline and with mlxspec's own reader (for
libedit and Pythons without readline); Ctrl-C stops an answer and drops what was queued
behind it; Ctrl-C at an empty prompt and Ctrl-D quit cleanly, bracketed paste turned off.

Real processes on a pseudo-terminal with a fake model (no weights: the child replaces
mlxspec.api.load) that records every conversation it is sent; the reader in process on a pty."""

import json
import os
import sys
import termios
import threading
import time

import pytest

from mlxspec.cli.chat import read_message
from mlxspec.cli.lineread import PASTE_END, PASTE_OFF, PASTE_ON, PASTE_START, LineReader
from test_cli import ROOT, Pty

CHILD = """
import json, os, sys, time
if os.environ["CHAT_READER"] == "own":
    sys.modules["readline"] = None  # as a Python without GNU readline: mlxspec reads the terminal
import mlxspec.api
from mlxspec.api import Chunk
from mlxspec.engine.stats import Stats


class Spec:
    name, is_demo = "fake", False
    target = type("Target", (), {"context_length": 100000})()

    class tokenizer:
        all_special_ids = []

        @staticmethod
        def decode(ids):
            return ""

    def encode(self, prompt, **options):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return [1] * sum(len(m["content"]) + 2 for m in messages)

    def stream(self, prompt, request, **options):
        with open(os.environ["CHAT_LOG"], "a") as f:
            f.write(json.dumps(prompt) + "\\n")
        yield Chunk(text="answer", tokens=[1], stats=Stats(generated_tokens=1))
        n = 1
        while "slow" in prompt[-1]["content"]:  # until Ctrl-C
            time.sleep(0.02)
            n += 1
            yield Chunk(text=" .", tokens=[1], stats=Stats(generated_tokens=n))


mlxspec.api.load = lambda *args, **kwargs: Spec()
from mlxspec.cli import main

sys.argv = ["mlxspec", "run", *sys.argv[1:]]
main()
"""


@pytest.fixture
def chat(tmp_path, monkeypatch):
    """Start the chat with the fake model on a pty -> (Pty, the conversations it was sent)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = tmp_path / "log.jsonl"

    def start(reader, *args):
        env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(tmp_path / "config"),
                   HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", NO_COLOR="1", TERM="xterm",
                   CHAT_READER=reader, CHAT_LOG=str(log))
        for name in ("MLXSPEC_DEFAULT_MODEL", "MLXSPEC_DEBUG", "MLXSPEC_PRESET", "MLXSPEC_DRAFTER"):
            env.pop(name, None)
        return Pty([sys.executable, str(script), *args], env)

    def sent():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return start, sent


READERS = ["readline", "own"]


def paste(pty, text):
    """Paste TEXT as a terminal does: between the markers if the chat turned bracketed paste on
    (and not off since), else as typed keys."""
    on = pty.output.rfind(PASTE_ON) > pty.output.rfind(PASTE_OFF)
    return pty.send(f"{PASTE_START}{text}{PASTE_END}" if on else text)


@pytest.mark.parametrize("reader", READERS)
def test_a_paste_of_many_lines_is_one_message(chat, reader):
    start, sent = chat
    pty = start(reader)
    paste(pty.expect(">>> "), "line1\nline2\rline3").send("\r")
    paste(pty.expect("answer").expect(">>> "), '"""a docstring"""\ndef f():\n    pass\n')  # no """ block
    pty.send("\r").expect("answer").expect(">>> ").send("after\r")
    pty.expect("answer").expect(">>> ").send("\x04")  # Ctrl-D quits
    assert pty.wait() == 0
    assert [c[-1]["content"] for c in sent()] == ["line1\nline2\nline3", '"""a docstring"""\ndef f():\n    pass',
                                                  "after"]
    assert PASTE_ON in pty.output  # asked for while reading
    assert pty.output.rfind(PASTE_OFF) > pty.output.rfind(PASTE_ON)  # and off at the end
    assert "Traceback" not in pty.output


@pytest.mark.parametrize("reader", READERS)
def test_ctrl_c_stops_the_answer_and_drops_what_was_queued(chat, reader):
    start, sent = chat
    pty = start(reader)
    paste(pty.expect(">>> "), "slow one\nslow two").send("\r")
    pty.expect("answer .")  # streaming
    pty.send("queued line\r")  # typed ahead while the answer streams
    pty.send("\x03")
    pty.expect("[stopped]").expect(">>> ").send("next\r")
    pty.expect("answer").expect(">>> ").send("/exit\r")
    assert pty.wait() == 0
    assert [c[-1]["content"] for c in sent()] == ["slow one\nslow two", "next"]
    assert sent()[-1][0]["content"] == "slow one\nslow two"  # the stopped exchange stays in the history


@pytest.mark.parametrize("reader", READERS)
def test_ctrl_c_at_an_empty_prompt_quits_cleanly(chat, reader):
    start, sent = chat
    pty = start(reader)
    # a moment after the prompt: a SIGINT in the instant between readline drawing the prompt
    # and waiting for a key is only seen at the next key (CPython's readline loop)
    pty.expect(">>> ")
    time.sleep(0.5)
    pty.send("\x03").expect("Ctrl-C again").expect(">>> ")
    time.sleep(0.5)
    pty.send("\x03")
    assert pty.wait() == 0
    assert pty.output.rfind(PASTE_OFF) > pty.output.rfind(PASTE_ON)
    assert "Traceback" not in pty.output and sent() == []


# -- the reader, in process on a pty ----------------------------------------------------------


class Terminal:
    """LineReader reading a pty in a thread; what it draws collected."""

    def __init__(self):
        self.master, self.slave = os.openpty()
        self.out = open(os.devnull, "w")  # noqa: SIM115
        self.reader = LineReader(self.slave, self.out)

    def read(self, *keys: str, prompt=">>> "):
        """What the reader returns for KEYS, each part written apart (a read of its own)."""
        result = {}

        def target():
            try:
                result["line"] = self.reader.read(prompt)
            except BaseException as err:  # noqa: BLE001
                result["error"] = err

        thread = threading.Thread(target=target)
        thread.start()
        deadline = time.monotonic() + 10
        while termios.tcgetattr(self.slave)[3] & termios.ICANON:  # keys once the reader reads them
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for part in keys:
            os.write(self.master, part.encode())
            time.sleep(0.1)
        thread.join(10)
        assert not thread.is_alive(), "the reader did not return"
        if "error" in result:
            raise result["error"]
        return result["line"]

    def close(self):
        self.out.close()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminal():
    term = Terminal()
    yield term
    term.close()


def test_reader_takes_a_paste_whole(terminal):
    text = "def f():\r\n\treturn 1\r" + "x" * 300 + "\r\n"
    assert terminal.read(f"{PASTE_START}{text}{PASTE_END}\r") == "def f():\n\treturn 1\n" + "x" * 300 + "\n"
    # markers cut between two reads
    assert terminal.read(PASTE_START[:3], f"{PASTE_START[3:]}a\nb{PASTE_END[:4]}", f"{PASTE_END[4:]}c\r") == "a\nbc"


def test_reader_edits_a_line(terminal):
    assert terminal.read("helo\x1b[D\x1b[Dl\r") == "hello"  # left twice, insert
    assert terminal.read("world\x01\x06\x7f\x05!\r") == "orld!"  # Home, right, backspace, End
    assert terminal.read("one two three\x17\x17four\r") == "one four"  # Ctrl-W twice
    assert terminal.read("abc\x15xyz\x01\x0b\r") == ""  # Ctrl-U, Home, Ctrl-K
    assert terminal.read("\x1b[A\x1b[A\r") == "orld!"  # Up twice: history
    assert terminal.read("draft\x1b[A\x1b[B\r") == "draft"  # Up, Down: the line being written


def test_reader_ctrl_c_and_ctrl_d(terminal):
    with pytest.raises(KeyboardInterrupt):
        terminal.read("typed\x03")
    with pytest.raises(EOFError):
        terminal.read("\x04")
    assert terminal.read("ab\x01\x04\r") == "b"  # Ctrl-D on text deletes


def test_a_pasted_message_starting_with_triple_quotes_is_not_a_block():
    asked = []

    def ask(prompt):
        asked.append(prompt)
        if len(asked) > 1:  # waiting for a closing """ that never comes
            raise EOFError
        return '"""doc"""\nx = 1\n'

    assert read_message(ask) == '"""doc"""\nx = 1' and asked == [">>> "]


def test_a_typed_triple_quote_block_is_one_message():
    lines = iter(['"""first', "second", 'third"""'])
    assert read_message(lambda prompt: next(lines)) == "first\nsecond\nthird"


def test_chat_help_says_a_paste_is_one_message():
    from mlxspec.cli.chat import CHAT_COMMANDS

    assert "paste" in CHAT_COMMANDS
