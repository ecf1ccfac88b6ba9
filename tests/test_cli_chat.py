"""The interactive chat of `mlxspec run`, in process: input() scripted, a fake model with a
small context. /help, /clear, multi-line input, Ctrl-C at the prompt, a conversation that
outgrows the context."""

import builtins

import pytest

from mlxspec.api import Chunk, GenerationRequest
from mlxspec.cli import chat as cli_chat
from mlxspec.engine.stats import Stats
from mlxspec.errors import UsageError


class ChatSpec:
    """One token per character of each message's content, plus 2 per message; a context of
    CONTEXT tokens, refused past it as the real API does; answers "ok"."""

    name, is_demo = "fake", False

    class tokenizer:
        all_special_ids = []

        @staticmethod
        def decode(ids):
            return ""

    def __init__(self, context=60):
        self.target = type("Target", (), {"context_length": context})()
        self.prompts = []

    def encode(self, prompt, **options):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return [1] * sum(len(m["content"]) + 2 for m in messages)

    def stream(self, prompt, request, **options):
        n = len(self.encode(prompt))
        if n >= self.target.context_length:
            raise UsageError(f"the prompt is {n} tokens but fake has a context of "
                             f"{self.target.context_length} tokens (max_position_embeddings); shorten the prompt")
        self.prompts.append([dict(m) for m in prompt])
        yield Chunk(text="ok", tokens=[1], stats=Stats(generated_tokens=1))


def run_chat(monkeypatch, capsys, script, spec=None, request=None):
    """Run the chat on SCRIPT (lines, or exceptions to raise from input()); -> (spec, stderr, prompts asked)."""
    spec = spec or ChatSpec()
    asked = []
    feed = iter(script)

    def fake_input(prompt=""):
        asked.append(prompt)
        item = next(feed, EOFError())
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr(builtins, "input", fake_input)
    cli_chat.chat(spec, request or GenerationRequest(max_tokens=8), show_stats=False, live=False)
    return spec, capsys.readouterr().err, asked


def test_help_lists_the_commands(monkeypatch, capsys):
    _, err, _ = run_chat(monkeypatch, capsys, ["/help"])
    for command in ("/help", "/reset", "/clear", "/stats", "/exit", '"""', "Ctrl-C", "Ctrl-D"):
        assert command in err, command


def test_clear_forgets_the_conversation(monkeypatch, capsys):
    spec, err, _ = run_chat(monkeypatch, capsys, ["one", "/clear", "two"])
    assert "conversation cleared" in err
    assert spec.prompts[-1] == [{"role": "user", "content": "two"}]


def test_triple_quotes_make_one_multi_line_message(monkeypatch, capsys):
    spec, _, asked = run_chat(monkeypatch, capsys, ['"""first line', "second line", 'third"""',
                                                    '"""one line"""'])
    assert spec.prompts[0][0]["content"] == "first line\nsecond line\nthird"
    assert spec.prompts[1][-1]["content"] == "one line"
    assert asked.count("... ") == 2  # continuation lines get their own prompt


def test_ctrl_c_at_the_prompt_does_not_quit_at_once(monkeypatch, capsys):
    spec, err, _ = run_chat(monkeypatch, capsys, [KeyboardInterrupt(), "still here", KeyboardInterrupt(),
                                                  KeyboardInterrupt(), "never read"])
    assert [p[-1]["content"] for p in spec.prompts] == ["still here"]
    assert "Ctrl-C again" in err or "Ctrl-D" in err


def test_a_conversation_longer_than_the_context_drops_its_oldest_turns(monkeypatch, capsys):
    turns = [f"message {i}" for i in range(8)]  # 12 tokens each, 4 for each answer
    spec, err, _ = run_chat(monkeypatch, capsys, turns)
    assert len(spec.prompts) == len(turns)  # every turn was answered
    assert "error" not in err
    assert "dropped" in err and "/reset" in err
    last = spec.prompts[-1]
    assert last[-1]["content"] == "message 7" and last[0]["content"] != "message 0"
    assert last[0]["role"] == "user"  # whole exchanges are dropped


def test_a_message_too_long_on_its_own_is_refused_and_the_conversation_kept(monkeypatch, capsys):
    spec, err, _ = run_chat(monkeypatch, capsys, ["hi", "x" * 100, "after"])
    assert "shorten" in err
    assert spec.prompts[-1][0]["content"] == "hi"  # the conversation before it is kept


@pytest.mark.parametrize("raw", ["caf\udce9"])
def test_undecodable_input_is_replaced(monkeypatch, capsys, raw):
    spec, err, _ = run_chat(monkeypatch, capsys, [raw])
    assert spec.prompts[0][0]["content"] == "caf\ufffd" and "UTF-8" in err
