"""Reasoning control: the <think> splitter, the template switch, both server surfaces (scripted
model text through the real request path, plus the real template on a tiny model) and `run`."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from typer.testing import CliRunner

from mlxspec import api, cli
from mlxspec.cli import chat as cli_chat
from mlxspec.engine.stats import Stats
from mlxspec.reasoning import MODES, ReasoningSplitter, split, starts_in_reasoning, template_kwargs
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
QWEN36 = (TEMPLATES / "Qwen3.6.jinja").read_text()
QWEN3 = (TEMPLATES / "Qwen3-0.6B.jinja").read_text()
HELLO = [{"role": "user", "content": "Hello"}]
KEY = "k"

# -- the splitter ---------------------------------------------------------------------------

CASES = [  # text, starts in reasoning, reasoning, content
    ("<think>\nI should greet.\n</think>\n\nHello there!", False, "I should greet.", "Hello there!"),
    ("I should greet.\n\n</think>\n\nHello!\nBye", True, "I should greet.", "Hello!\nBye"),
    ("<think>\n\n</think>\n\nJust the answer", False, "", "Just the answer"),
    ("\n</think>\n\nNo thoughts", True, "", "No thoughts"),
    ("Plain text, a < b and <b>bold</b>, no tags", False, "", "Plain text, a < b and <b>bold</b>, no tags"),
    ("<think>\nstill thinking when max_tokens hit\n", False, "still thinking when max_tokens hit", ""),
    ("mid-thought </thin", True, "mid-thought </thin", ""),
    ("Answer then <think", False, "", "Answer then <think"),
]


def merged(pieces):
    """Adjacent pieces of one kind joined; checks no piece is empty."""
    out: list[list[str]] = []
    for kind, text in pieces:
        assert kind in ("reasoning", "content") and text
        if out and out[-1][0] == kind:
            out[-1][1] += text
        else:
            out.append([kind, text])
    return [tuple(p) for p in out]


def expected(reasoning, content):
    return [p for p in (("reasoning", reasoning), ("content", content)) if p[1]]


@pytest.mark.parametrize("text, in_reasoning, reasoning, content", CASES)
def test_splitter_at_every_split_position(text, in_reasoning, reasoning, content):
    want = expected(reasoning, content)
    assert split(text, in_reasoning) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):  # three chunks: a tag may span all of them
            s = ReasoningSplitter(in_reasoning)
            pieces = s.feed(text[:i]) + s.feed(text[i:j]) + s.feed(text[j:]) + s.finish()
            assert merged(pieces) == want, (i, j)
    s = ReasoningSplitter(in_reasoning)
    assert merged([p for ch in text for p in s.feed(ch)] + s.finish()) == want


def test_splitter_holds_back_only_a_possible_tag():
    s = ReasoningSplitter()
    assert s.feed("Hi <") == [("content", "Hi ")]
    assert s.feed("b> x") == [("content", "<b> x")]
    assert s.feed(" <thi") == [("content", " ")]
    assert s.feed("nk>\nplan") == [("reasoning", "plan")]
    assert s.feed(" more\n") == [("reasoning", " more")]  # a newline that may precede </think>
    assert s.feed("next") == [("reasoning", "\nnext")]
    assert s.feed("</think>") == [] and s.in_reasoning is False
    assert s.feed("\n\nDone") == [("content", "Done")] and s.finish() == []


def test_template_kwargs_mapping():
    assert MODES == ("on", "off", "auto")
    assert template_kwargs("on") == {"enable_thinking": True}
    assert template_kwargs("off") == {"enable_thinking": False}
    assert template_kwargs("auto") == {}
    with pytest.raises(ValueError):
        template_kwargs("maybe")


# -- the template, on a tiny model ------------------------------------------------------------

@pytest.fixture(scope="module")
def spec(tiny_qwen3):
    return api.load(str(tiny_qwen3))


@pytest.fixture
def template(spec, monkeypatch):
    """Install a real chat template on the tiny model's tokenizer (ChatML by default)."""
    def use(text):
        monkeypatch.setattr(spec.tokenizer._tokenizer, "chat_template", text)
    return use


def test_starts_in_reasoning_from_the_prompt(spec, template):
    tok = spec.tokenizer
    template(QWEN36)  # Qwen3.5/3.6: thinking on ends the prompt inside <think>
    on = spec.encode(HELLO, template_kwargs=template_kwargs("on"))
    off = spec.encode(HELLO, template_kwargs=template_kwargs("off"))
    assert tok.decode(on).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert starts_in_reasoning(tok, on) and not starts_in_reasoning(tok, off)
    prefill = off + list(tok.encode("<think>\nLet me see", add_special_tokens=False))
    assert starts_in_reasoning(tok, prefill)  # an assistant prefill that opened the reasoning
    template(QWEN3)  # Qwen3: the model writes <think> itself
    asked = spec.encode([{"role": "user", "content": "what does <think> mean?"}],
                        template_kwargs={"enable_thinking": True})
    assert "<think>" in tok.decode(asked) and not starts_in_reasoning(tok, asked)  # a user's tag opens nothing
    assert not starts_in_reasoning(tok, spec.encode(HELLO, template_kwargs={"enable_thinking": True}))


# -- the server, with the model's text scripted -------------------------------------------------

class Scripted:
    """Stands in for the model in the worker: yields TEXT in 3-character chunks."""

    def __init__(self, text):
        self.text, self.calls = text, []

    def stream(self, **kwargs):
        self.calls.append(kwargs)
        for i in range(0, len(self.text), 3):
            yield api.Chunk(text=self.text[i:i + 3], tokens=[1], stats=Stats())


@pytest.fixture(scope="module")
def app(spec):
    return create_app(spec, Settings(model_name="tiny", api_key=KEY, max_tokens_cap=64))


@pytest.fixture(scope="module")
def url(app):
    with running(app) as base:
        yield base


@pytest.fixture
def script(app, monkeypatch):
    def use(text):
        fake = Scripted(text)
        monkeypatch.setattr(app.state.server.worker, "spec", fake)
        return fake
    return use


def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


THOUGHT = "<think>\nThe user says hello.\nGreet back.\n</think>\n\nHello! How can I help?"


def openai_stream(url, **kw):
    chunks = list(oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=32, stream=True, **kw))
    kinds = []
    for c in chunks:
        for kind in ("reasoning_content", "content"):
            piece = getattr(c.choices[0].delta, kind, None) if c.choices else None
            if piece:
                if not kinds or kinds[-1][0] != kind:
                    kinds.append([kind, ""])
                kinds[-1][1] += piece
    return [tuple(k) for k in kinds], chunks


def test_openai_reasoning_content(url, script, template):
    script(THOUGHT)
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=32)
    msg = r.choices[0].message
    assert msg.content == "Hello! How can I help?"
    assert msg.reasoning_content == "The user says hello.\nGreet back."
    assert r.usage.completion_tokens == len(range(0, len(THOUGHT), 3))  # counting as before
    pieces, chunks = openai_stream(url)
    assert pieces == [("reasoning_content", "The user says hello.\nGreet back."),
                      ("content", "Hello! How can I help?")]
    assert chunks[-1].choices[0].finish_reason == "stop"
    script("Just an answer")  # no reasoning: no reasoning_content at all
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=32)
    assert r.choices[0].message.content == "Just an answer"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    # Qwen3.6 with thinking on: the prompt opened <think>, the model only closes it
    template(QWEN36)
    script("Thinking inside.\n</think>\n\nDone.")
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=32, extra_body={"reasoning": "on"})
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Thinking inside.", "Done.")
    pieces, _ = openai_stream(url, extra_body={"reasoning": "on"})
    assert pieces == [("reasoning_content", "Thinking inside."), ("content", "Done.")]


def test_openai_tools_and_stop_apply_to_the_answer(url, script, template):
    template(QWEN3)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    script("<think>\nI need the weather; a <tool_call> is due.\n</think>\n\n" + call)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=32, tools=tools)
    msg = r.choices[0].message
    assert msg.reasoning_content == "I need the weather; a <tool_call> is due."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"] and not msg.content
    assert r.choices[0].finish_reason == "tool_calls"
    script(THOUGHT)
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=32, stop=["!"])
    assert r.choices[0].message.content == "Hello" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.reasoning_content == "The user says hello.\nGreet back."
    text = oai(url).completions.create(model="tiny", prompt="x", max_tokens=32).choices[0].text
    assert text == THOUGHT  # raw completions are not split


def test_anthropic_thinking_blocks(url, script, template):
    script(THOUGHT)
    msg = claude(url).messages.create(model="tiny", max_tokens=32, messages=HELLO)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user says hello.\nGreet back." and msg.content[0].signature == ""
    assert msg.content[1].text == "Hello! How can I help?" and msg.stop_reason == "end_turn"
    with claude(url).messages.stream(model="tiny", max_tokens=32, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert final.model_dump()["content"] == msg.model_dump()["content"]
    raw = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "tiny", "max_tokens": 32, "messages": HELLO, "stream": True}).text
    events = [json.loads(f.split("data: ", 1)[1]) for f in raw.strip().split("\n\n")]
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
             for e in events if e["type"].startswith("content_block")]
    n_think = sum(1 for s in shape if s == ("content_block_delta", 0, "thinking_delta"))
    n_text = sum(1 for s in shape if s == ("content_block_delta", 1, "text_delta"))
    assert n_think and n_text
    assert shape == ([("content_block_start", 0, "thinking")] + [("content_block_delta", 0, "thinking_delta")] * n_think
                     + [("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
                        ("content_block_start", 1, "text")] + [("content_block_delta", 1, "text_delta")] * n_text
                     + [("content_block_stop", 1, None)])
    # omitted display: the block is there, its text is not; Qwen3.6 thinking on starts inside it
    template(QWEN36)
    script("Inside.\n</think>\n\nOut.")
    msg = claude(url).messages.create(model="tiny", max_tokens=32, messages=HELLO,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", "Inside."), ("text", "Out.")]
    msg = claude(url).messages.create(model="tiny", max_tokens=32, messages=HELLO,
                                      thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in msg.content] == [("thinking", ""), ("text", None)]


def test_past_reasoning_goes_back_through_the_template():
    """A past turn's thinking block / reasoning_content reaches the template as reasoning_content
    (Qwen templates render it after the last user turn, e.g. around tool calls)."""
    from mlxspec.server import anthropic as surface

    body = surface.MessagesBody(model="tiny", max_tokens=8, messages=HELLO + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Greet back.", "signature": ""}, {"type": "text", "text": "Hi!"}]}])
    assert surface.template_messages(body)[-1] == {"role": "assistant", "content": "Hi!",
                                                   "reasoning_content": "Greet back."}
    from mlxspec.server import openai as oai_surface

    msgs = oai_surface.ChatRequest(messages=HELLO + [{"role": "assistant", "content": "Hi!",
                                                      "reasoning_content": "Greet back."}]).messages
    assert oai_surface._template_messages(msgs)[-1] == {"role": "assistant", "content": "Hi!",
                                                        "reasoning_content": "Greet back."}


# -- the real template on the real tiny model: enable_thinking reaches it ---------------------

@pytest.fixture
def prompts(app, monkeypatch):
    """Prompts the server generates from, decoded; generation is the real model's."""
    server, seen = app.state.server, []
    real = server.generate

    async def spy(request, gen, outcome):
        seen.append(server.spec.tokenizer.decode(gen.prompt_ids))
        async for delta in real(request, gen, outcome):
            yield delta

    monkeypatch.setattr(server, "generate", spy)
    return seen


OFF_TAIL, ON_TAIL = "assistant\n<think>\n\n</think>\n\n", "assistant\n<think>\n"


def test_constrained_output_runs_with_reasoning_off(app, url, template, prompts, monkeypatch):
    """A JSON schema, a regex or a forced tool call holds from the answer's first token: such a
    request renders with reasoning off, and asking for reasoning with one is a 400."""
    template(QWEN36)
    monkeypatch.setattr(app.state.server.settings, "reasoning", "on")  # the server's default: thinking
    fmt = {"type": "json_object"}
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, temperature=0,
                                         response_format=fmt)
    assert prompts[-1].endswith(OFF_TAIL)
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError, match="cannot follow reasoning"):
        oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, response_format=fmt,
                                         extra_body={"reasoning": "on"})
    body = {"model": "tiny", "messages": HELLO, "format": "json", "stream": False}
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/api/chat", json=body, headers=auth).status_code == 200
    assert prompts[-1].endswith(OFF_TAIL)
    bad = httpx.post(url + "/api/chat", json=body | {"think": True}, headers=auth)
    assert bad.status_code == 400 and "cannot follow reasoning" in bad.json()["error"]


def test_a_template_that_always_thinks_refuses_constrained_output(app, url, template, monkeypatch):
    template("{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant\n<think>\n")
    with pytest.raises(openai.BadRequestError, match="starts every answer with reasoning"):
        oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=4,
                                         response_format={"type": "json_object"})


def test_reasoning_reaches_the_template_end_to_end(spec, app, url, template, prompts, monkeypatch):
    template(QWEN36)
    monkeypatch.setattr(app.state.server.settings, "reasoning", "off")  # as `serve --reasoning off`
    greedy = {"temperature": 0}
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, **greedy)
    assert prompts[-1].endswith(OFF_TAIL)
    ids = spec.encode(HELLO, template_kwargs={"enable_thinking": False})
    assert r.choices[0].message.content == split(spec.generate(ids, max_tokens=6, temperature=0).text)[1]
    # per request: reasoning_effort over the server default, chat_template_kwargs over both
    r = oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, reasoning_effort="high", **greedy)
    assert prompts[-1].endswith(ON_TAIL)
    ids = spec.encode(HELLO, template_kwargs={"enable_thinking": True})
    thought, answer = split(spec.generate(ids, max_tokens=6, temperature=0).text, True)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (thought or None, answer)
    assert thought  # the random model never closes </think>: all it wrote is reasoning
    oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, extra_body={
        "reasoning": {"enabled": True}, "chat_template_kwargs": {"enable_thinking": False}})
    assert prompts[-1].endswith(OFF_TAIL)
    monkeypatch.setattr(app.state.server.settings, "reasoning", "on")
    oai(url).chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                     extra_body={"reasoning": {"effort": "none"}})
    assert prompts[-1].endswith(OFF_TAIL)
    msg = claude(url).messages.create(model="tiny", max_tokens=6, messages=HELLO, extra_body=greedy)
    assert prompts[-1].endswith(ON_TAIL) and [b.type for b in msg.content] == ["thinking"]
    assert msg.content[0].thinking == thought
    claude(url).messages.create(model="tiny", max_tokens=2, messages=HELLO, thinking={"type": "disabled"})
    assert prompts[-1].endswith(OFF_TAIL)
    counts = [claude(url).messages.count_tokens(model="tiny", messages=HELLO, thinking=t).input_tokens
              for t in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024})]
    assert counts == [len(spec.encode(HELLO, template_kwargs=template_kwargs(m))) for m in ("off", "on")]
    assert counts[0] > counts[1]


@pytest.mark.parametrize("body, needle", [
    ({"reasoning": "maybe"}, "reasoning must be one of on, off, auto"),
    ({"reasoning": 3}, "reasoning must be"),
    ({"reasoning": {"enabled": "yes"}}, "reasoning.enabled must be true or false"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort must be one of"),
    ({"reasoning": {"budget": 5}}, "unknown reasoning field(s): budget"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort must be one of none,"),
    ({"reasoning": "on", "reasoning_effort": "none"}, "disagree"),
    ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs may not set tokenize"),
])
def test_bad_reasoning_fields_are_openai_400s(url, body, needle):
    r = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": KEY},
                   json={"messages": HELLO, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("body, needle", [
    ({"thinking": {"type": "sometimes"}}, "thinking must be"),
    ({"thinking": "on"}, "thinking must be"),
    ({"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens must be a positive integer"),
    ({"thinking": {"type": "enabled", "effort": "high"}}, "unknown thinking field(s): effort"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs must be an object"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "may not set add_generation_prompt"),
])
def test_bad_thinking_fields_are_anthropic_400s(url, path, body, needle):
    r = httpx.post(url + path, headers={"x-api-key": KEY},
                   json={"model": "tiny", "max_tokens": 2, "messages": HELLO, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


# -- mlxspec run ------------------------------------------------------------------------------

class FakeSpec:
    """Writes TEXT in 2-character chunks; its prompt ends with TAIL."""

    name, is_demo = "fake", False

    def __init__(self, text, tail="<|im_start|>assistant\n"):
        self.text, self.calls = text, []
        tokenizer = type("Tok", (), {"all_special_ids": [], "decode": staticmethod(lambda ids: tail)})
        self.tokenizer = tokenizer()

    def encode(self, prompt, **options):
        return [7]

    def stream(self, prompt, request, **options):
        self.calls.append((prompt, vars(request) | options))
        for i in range(0, len(self.text), 2):
            yield api.Chunk(text=self.text[i:i + 2], tokens=[i], stats=Stats(generated_tokens=1))

    def generate(self, prompt, **options):
        return api.Result(text=self.text, tokens=[1], stats=Stats())


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("MLXSPEC_REASONING", raising=False)
    made = []

    def use(text, **kw):
        made.append(FakeSpec(text, **kw))
        monkeypatch.setattr("mlxspec.api.load", lambda model_ref, draft_model=None: made[-1])
        return made[-1]
    return use


def run(*args, env=None):
    return CliRunner().invoke(cli.app, ["run", "m", "p", "--no-stats", *args], env=env)


def test_run_prints_reasoning_piped_as_written_or_hides_it(fake):
    spec = fake("<think>\nhmm, greet\n</think>\n\nHello!")
    assert run().stdout == "<think>\nhmm, greet\n</think>\n\nHello!\n"
    assert spec.calls[-1][1]["template_kwargs"] == {}  # auto: the template's default
    assert run("--hide-reasoning").stdout == "Hello!\n"
    spec = fake("hmm\n</think>\n\nHello!", tail="<|im_start|>assistant\n<think>\n")  # the prompt opened it
    assert run().stdout == "<think>\nhmm\n</think>\n\nHello!\n"
    assert run("--hide-reasoning").stdout == "Hello!\n"


def test_run_with_a_constraint_turns_reasoning_off(fake):
    spec = fake("Hello")
    run("--regex", "[A-Za-z]+")
    assert spec.calls[-1][1]["template_kwargs"] == {"enable_thinking": False}
    bad = run("--regex", "[a-z]+", "--reasoning", "on")
    assert bad.exit_code == 2 and "cannot follow reasoning" in bad.stderr


def test_run_json_and_reasoning_flag(fake):
    fake("<think>\nhmm\n</think>\n\nHello!")
    out = json.loads(run("--json").stdout)
    assert (out["text"], out["reasoning"]) == ("Hello!", "hmm") and "stats" in out
    assert json.loads(run("--json", "--hide-reasoning").stdout)["reasoning"] is None
    spec = fake("Hello!")
    assert json.loads(run("--json", "--reasoning", "off").stdout) | {"stats": 0} == {
        "model": "fake", "text": "Hello!", "reasoning": None, "finish_reason": None, "tokens": [1], "stats": 0}
    run("--reasoning", "on")
    assert spec.calls[-1][1]["template_kwargs"] == {"enable_thinking": True}
    run(env={"MLXSPEC_REASONING": "off"})
    assert spec.calls[-1][1]["template_kwargs"] == {"enable_thinking": False}
    bad = run("--reasoning", "maybe")
    assert bad.exit_code == 2 and bad.stderr == "error: unknown --reasoning 'maybe'; choose one of on, off, auto\n"
    bad = run(env={"MLXSPEC_REASONING": "loud"})
    assert bad.exit_code != 0 and bad.stderr.count("\n") == 1 and "$MLXSPEC_REASONING must be one of" in bad.stderr
    help_text = CliRunner().invoke(cli.app, ["run", "--help"]).output
    assert "--reasoning" in help_text and "--hide-reasoning" in help_text
    assert "--reasoning" in CliRunner().invoke(cli.app, ["serve", "--help"]).output


@pytest.mark.parametrize("live", [True, False])
def test_terminal_shows_reasoning_dimmed(fake, monkeypatch, live):
    from rich.console import Console

    buffer = io.StringIO()
    monkeypatch.setattr(cli_chat, "stdout_console",
                        lambda: Console(file=buffer, force_terminal=True, color_system="standard", width=60))
    spec = fake("<think>\nhmm, greet\n</think>\n\nHello!")
    answer = cli_chat.Answer(live).stream(spec, "p", api.GenerationRequest())
    assert (answer.reasoning, answer.text) == ("hmm, greet", "Hello!")
    out = buffer.getvalue().replace("\x1b[0m\x1b[2m", "")  # Rich ends and restarts dim per chunk
    assert "\x1b[2mhmm, greet" in out and "Hello!" in out and "<think>" not in out
    assert out.index("hmm, greet") < out.index("Hello!") and "\x1b[2mHello" not in out
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    assert "hmm, greet\n\n" in plain and plain.endswith("Hello!\n")  # a blank line before the answer
    buffer.truncate(0)
    cli_chat.Answer(live, hide_reasoning=True).stream(spec, "p", api.GenerationRequest())
    assert "hmm" not in buffer.getvalue() and "Hello!" in buffer.getvalue()


def test_chat_history_keeps_only_the_answer(fake, monkeypatch):
    spec = fake("<think>\nhmm\n</think>\n\nHello!")
    lines = iter(["first", "second", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    cli_chat.chat(spec, api.GenerationRequest(), show_stats=False, live=False)
    assert spec.calls[1][0] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "second"}]


def test_run_reasoning_reaches_the_real_template(spec, template, monkeypatch):
    """`run --reasoning on|off` with a real model and the Qwen3.6 template: on, the prompt ends
    inside <think> and all the random model writes is reasoning; off, it is the answer."""
    template(QWEN36)
    monkeypatch.setattr("mlxspec.api.load", lambda model_ref, draft_model=None: spec)
    args = ["run", "m", "Hello", "--json", "--max-tokens", "5", "--temp", "0", "--drafter", "none"]
    on = json.loads(CliRunner().invoke(cli.app, args + ["--reasoning", "on"]).stdout)
    off = json.loads(CliRunner().invoke(cli.app, args + ["--reasoning", "off"]).stdout)
    ids = spec.encode("Hello", template_kwargs={"enable_thinking": True})
    assert (on["reasoning"], on["text"]) == (split(spec.generate(ids, max_tokens=5, temperature=0).text, True)[0], "")
    assert on["reasoning"] and off["reasoning"] is None and off["text"]
