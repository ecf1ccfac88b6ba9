"""`mlxspec serve`'s Ollama surface through the official `ollama` client: text identical to the
OpenAI surface at temperature 0 (chat and generate, streaming or not), options, the model
endpoints, auth, error shapes, tool calls, thinking, format, clients that leave. A real uvicorn
server on 127.0.0.1 over the tiny offline model."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from mlxspec.api import Chunk, load
from mlxspec.engine.stats import Stats
from mlxspec.options import OLLAMA_DEFAULTS, ConstraintSpec
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running

MSG = [{"role": "user", "content": "def add(a, b): return a + b\ndef add(a, b):"}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def spec(tiny_qwen3):
    return load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def served(spec):
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=256, max_queue=64, max_body_bytes=64 * 1024))
    with running(app) as url:
        yield url, app


def _client(url, **kw) -> ollama.Client:
    return ollama.Client(host=url, **kw)


def _openai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


class Capture:
    """The server's generation swapped for a scripted one: PIECES of text, the request kept."""

    def __init__(self, pieces):
        self.pieces, self.gen = pieces, None

    async def __call__(self, request, gen, outcome):
        self.gen = gen
        for p in self.pieces:
            outcome.completion_tokens += 1
            yield p


def _what_to_answer(path: str) -> dict:
    """The body's messages (/api/chat) or prompt (/api/generate): the other is a 400 there."""
    return {"messages": MSG} if path == "/api/chat" else {"prompt": "x"}


# -- the text is the OpenAI surface's ------------------------------------------------------------

def test_chat_at_temperature_zero_is_the_openai_surfaces_text_streaming_or_not(served):
    url, app = served
    expected = _openai(url).chat.completions.create(model="tiny", messages=MSG, max_tokens=24,
                                                    temperature=0).choices[0].message.content
    assert expected
    client = _client(url)
    r = client.chat(model="tiny", messages=MSG, options=GREEDY)
    assert r.message.content == expected and r.message.role == "assistant"
    assert r.done and r.done_reason == "length" and r.eval_count == 24
    assert r.prompt_eval_count == len(app.state.server.encode_chat(MSG))
    assert r.total_duration > 0 and r.eval_duration > 0 and r.load_duration == 0
    parts = list(client.chat(model="tiny:latest", messages=MSG, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == expected
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 24
    for drafter in ("pld", "none"):  # speculation fields as on the other surfaces
        body = {"model": "tiny", "messages": MSG, "options": GREEDY, "stream": False,
                "speculation": {"drafter": drafter}}
        r = httpx.post(url + "/api/chat", json=body, timeout=60).json()
        assert r["message"]["content"] == expected and r["speculation"]["drafter"] == drafter


def test_generate_matches_chat_and_raw_matches_completions(served):
    url, _ = served
    client, oa = _client(url), _openai(url)
    chat = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=24, temperature=0)
    r = client.generate(model="tiny", prompt=MSG[0]["content"], options=GREEDY)
    assert r.response == chat.choices[0].message.content and r.done_reason == "length"
    streamed = list(client.generate(model="tiny", prompt=MSG[0]["content"], options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == r.response and streamed[-1].done
    prompt = "def add(a, b):\n    return"
    completion = oa.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0).choices[0].text
    raw = client.generate(model="tiny", prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 20})
    assert raw.response == completion
    system = client.generate(model="tiny", prompt=MSG[0]["content"], system="You are terse.", options=GREEDY)
    with_system = oa.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "You are terse."},
                                                                     *MSG], max_tokens=24, temperature=0)
    assert system.response == with_system.choices[0].message.content


def test_streams_are_ndjson_by_default(served):
    url, _ = served
    with httpx.stream("POST", url + "/api/generate", json={"model": "tiny", "prompt": "hi", "options": GREEDY},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) > 2 and lines[-1]["done"] is True and not any(x["done"] for x in lines[:-1])
    assert all(x["model"] == "tiny" and x["created_at"].endswith("Z") for x in lines)


# -- options -----------------------------------------------------------------------------------

def test_options_num_predict_stop_and_seed(served):
    url, _ = served
    client = _client(url)
    short = client.chat(model="tiny", messages=MSG, options={"temperature": 0, "num_predict": 5})
    assert short.eval_count == 5 and short.done_reason == "length"
    full = client.chat(model="tiny", messages=MSG, options=GREEDY).message.content
    stop = full[3:5]
    cut = client.chat(model="tiny", messages=MSG, options={**GREEDY, "stop": [stop]})
    assert cut.message.content == full[: full.index(stop)] and cut.done_reason == "stop"
    sampled = {"temperature": 0.9, "num_predict": 12, "seed": 7, "top_k": 0, "top_p": 1.0}
    a, b = (client.chat(model="tiny", messages=MSG, options=sampled).message.content for _ in range(2))
    assert a == b
    # how Ollama loads a model, and samplers at their "off" value: accepted, no effect (ollama_options.py)
    ignored = {**GREEDY, "num_ctx": 4096, "mirostat": 0, "num_gpu": 99}
    assert client.chat(model="tiny", messages=MSG, options=ignored).message.content == full
    penalized = client.chat(model="tiny", messages=MSG, options={**GREEDY, "repeat_penalty": 1.5}).message.content
    assert penalized != full  # a real penalty now, no longer ignored


def test_options_reach_the_generation_request_with_ollamas_defaults(served, monkeypatch):
    url, app = served
    capture = Capture(["ok"])
    monkeypatch.setattr(app.state.server, "generate", capture)
    client = _client(url)
    client.chat(model="tiny", messages=MSG)
    g = capture.gen.generation
    assert {k: getattr(g, k) for k in OLLAMA_DEFAULTS} == OLLAMA_DEFAULTS
    assert g.max_tokens == 256 and g.seed is None  # num_predict unset: up to the server's cap
    client.chat(model="tiny", messages=MSG, options={"temperature": 0.3, "top_p": 0.5, "top_k": 7, "min_p": 0.1,
                                                      "seed": 11, "num_predict": 9, "stop": ["x"]})
    g = capture.gen.generation
    assert (g.temperature, g.top_p, g.top_k, g.min_p, g.seed, g.max_tokens) == (0.3, 0.5, 7, 0.1, 11, 9)
    assert capture.gen.stop == ["x"]
    client.chat(model="tiny", messages=MSG, options={"top_k": 5.0, "num_predict": 3.0})  # integral floats
    assert (capture.gen.generation.top_k, capture.gen.generation.max_tokens) == (5, 3)
    client.chat(model="tiny", messages=MSG, options={"seed": -1, "num_predict": -1})
    assert capture.gen.generation.seed is None and capture.gen.generation.max_tokens == 256


def test_format_becomes_constrained_output(served, monkeypatch):
    url, app = served
    capture = Capture(["{}"])
    monkeypatch.setattr(app.state.server, "generate", capture)
    client = _client(url)
    client.chat(model="tiny", messages=MSG, format="json")
    assert capture.gen.generation.constraint == ConstraintSpec("json")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    client.generate(model="tiny", prompt="x", format=schema)
    assert capture.gen.generation.constraint == ConstraintSpec("json_schema", schema)
    client.chat(model="tiny", messages=MSG)
    assert capture.gen.generation.constraint is None
    r = httpx.post(url + "/api/chat", json={"model": "tiny", "messages": MSG, "format": "yaml", "stream": False})
    assert r.status_code == 400 and "format" in r.json()["error"]


# -- tools and thinking --------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_come_back_in_ollamas_format_streaming_or_not(served, spec, monkeypatch):
    url, app = served
    capture = Capture(["Let me check. ", CALL[:9], CALL[9:30], CALL[30:]])
    monkeypatch.setattr(app.state.server, "generate", capture)
    template = (Path(__file__).parent / "data" / "chat_templates" / "Qwen3-0.6B.jinja").read_text()
    monkeypatch.setattr(spec.tokenizer._tokenizer, "chat_template", template)
    client = _client(url)
    r = client.chat(model="tiny", messages=MSG, tools=TOOLS)
    assert r.message.content == "Let me check. "
    (tc,) = r.message.tool_calls
    assert tc.function.name == "get_weather" and tc.function.arguments == {"city": "Paris"}
    assert len(capture.gen.prompt_ids) > len(app.state.server.encode_chat(MSG))  # the schema is in the prompt
    parts = list(client.chat(model="tiny", messages=MSG, tools=TOOLS, stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    # the call and its result go back in: the template renders both
    history = MSG + [{"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21C", "tool_name": "get_weather"}]
    client.chat(model="tiny", messages=history, tools=TOOLS)
    text = spec.tokenizer.decode(capture.gen.prompt_ids)
    assert '"city": "Paris"' in text and "sunny, 21C" in text


def test_thinking_is_split_out_and_think_switches_the_template(served, monkeypatch):
    url, app = served
    capture = Capture(["<think>\nhm", "m\n</think>\n\n", "answer"])
    monkeypatch.setattr(app.state.server, "generate", capture)
    seen = []
    chat_prompt = app.state.server.chat_prompt

    def spy(messages, tools, kwargs):
        seen.append(kwargs)
        return chat_prompt(messages, tools, kwargs)

    monkeypatch.setattr(app.state.server, "chat_prompt", spy)
    client = _client(url)
    r = client.chat(model="tiny", messages=MSG, think=True)
    assert (r.message.thinking, r.message.content) == ("hmm", "answer")
    parts = list(client.chat(model="tiny", messages=MSG, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "hmm"
    assert "".join(p.message.content for p in parts) == "answer"
    g = client.generate(model="tiny", prompt="x", think=False)
    assert (g.thinking, g.response) == ("hmm", "answer")
    assert [k.get("enable_thinking") for k in seen] == [True, None, False]
    assert client.chat(model="tiny", messages=MSG, think="high").message.content == "answer"


# -- the model endpoints -------------------------------------------------------------------------

def test_tags_show_ps_and_version(served):
    url, _ = served
    client = _client(url)
    (m,) = client.list().models
    assert m.model == "tiny" and m.details.family == "qwen3" and m.details.format == "mlx"
    assert m.size > 0 and len(m.digest) == 64 and m.details.parameter_size.endswith(("K", "M", "B"))
    shown = client.show("tiny")
    assert "completion" in shown.capabilities and shown.details.family == "qwen3"
    assert shown.modelinfo["general.architecture"] == "qwen3" and shown.modelinfo["qwen3.context_length"] > 0
    assert shown.modelinfo["general.parameter_count"] > 0 and "im_start" in shown.template
    assert "temperature     0.8" in shown.parameters
    (p,) = client.ps().models
    assert p.model == "tiny" and p.context_length == shown.modelinfo["qwen3.context_length"]
    v = httpx.get(url + "/api/version").json()
    assert v["version"].count(".") == 2 and "mlxspec" in v
    assert httpx.get(url + "/").text == "Ollama is running"
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3")
    assert err.value.status_code == 404 and "llama3" in err.value.error


def test_empty_requests_load_the_model_as_ollama_does(served):
    url, _ = served
    client = _client(url)
    r = client.chat(model="tiny", messages=[])
    assert r.done and r.done_reason == "load" and r.message.content == ""
    assert client.generate(model="tiny", keep_alive=0).done_reason == "unload"


# -- errors, auth ------------------------------------------------------------------------------

@pytest.mark.parametrize("body, where", [
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": MSG, "options": {"temperature": "hot"}}, "options.temperature"),
    ({"model": "tiny", "messages": MSG, "options": {"top_p": 1.5}}, "options.top_p"),
    ({"model": "tiny", "messages": MSG, "options": {"top_k": 1.5}}, "options.top_k"),
    ({"model": "tiny", "messages": MSG, "options": {"num_predict": 100000}}, "options.num_predict"),
    ({"model": "tiny", "messages": MSG, "options": {"stop": [1]}}, "options.stop"),
    ({"model": "tiny", "messages": MSG, "options": "hot"}, "options"),
    ({"model": "tiny", "messages": MSG, "think": "maybe"}, "think"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}], "stream": False},
     "images"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}], "stream": False}, "messages.0.role"),
    ({"model": "tiny", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
      "stream": False}, "tools.0.function.parameters"),
    ({"model": "tiny", "messages": MSG, "speculation": {"drafter": "magic"}}, "speculation.drafter"),
    ({"messages": MSG}, "model"),
])
def test_malformed_bodies_are_400_with_ollamas_error_shape(served, body, where):
    url, _ = served
    r = httpx.post(url + "/api/chat", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and where in r.json()["error"]


def test_bad_json_unknown_model_and_generate_fields(served):
    url, _ = served
    r = httpx.post(url + "/api/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"error": "the request body is not valid JSON"}
    with pytest.raises(ollama.ResponseError) as err:
        _client(url).chat(model="llama3", messages=MSG)
    assert err.value.status_code == 404 and "tiny" in err.value.error
    for field, value in (("images", ["aGk="]), ("suffix", "end"), ("context", [1, 2])):
        r = httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "x", field: value})
        assert r.status_code == 400 and field in r.json()["error"]
        # suffix is fill-in-the-middle, refused only because this model has no FIM tokens
        assert (field == "suffix") == ("fill-in-the-middle" in r.json()["error"])


def test_a_key_is_required_when_the_server_has_one(spec):
    app = create_app(spec, Settings(model_name="tiny", api_key="sekret", max_tokens_cap=64))
    with running(app) as url:
        with pytest.raises(ollama.ResponseError) as err:
            _client(url).list()
        assert err.value.status_code == 401 and "API key" in err.value.error
        with pytest.raises(ollama.ResponseError):
            _client(url, headers={"Authorization": "Bearer wrong"}).chat(model="tiny", messages=MSG)
        client = _client(url, headers={"Authorization": "Bearer sekret"})
        assert client.list().models[0].model == "tiny"
        assert client.chat(model="tiny", messages=MSG, options={"temperature": 0, "num_predict": 3}).eval_count == 3
        metrics = httpx.get(url + "/metrics", headers={"x-api-key": "sekret"}).text
        assert 'surface="ollama",status="401"' in metrics and 'surface="ollama",status="200"' in metrics


# -- clients that leave ----------------------------------------------------------------------------

class Scripted:
    """The worker's model: one "a" every 20 ms up to max_tokens; whether each stream was closed."""

    def __init__(self):
        self.calls: list[dict] = []

    def stream(self, prompt, request):
        call = {"made": 0, "closed": threading.Event()}
        self.calls.append(call)
        try:
            for _ in range(request.max_tokens):
                time.sleep(0.02)
                call["made"] += 1
                yield Chunk(text="a", tokens=[1], stats=Stats())
        finally:
            call["closed"].set()


@pytest.mark.parametrize("path, stream", [("/api/chat", False), ("/api/chat", True), ("/api/generate", True)])
def test_a_client_that_leaves_stops_its_generation(spec, monkeypatch, path, stream):
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=4096))
    model = Scripted()
    monkeypatch.setattr(app.state.server.worker, "spec", model)
    body = {"model": "tiny", **_what_to_answer(path), "stream": stream, "options": {"num_predict": 2000}}
    with running(app) as url:
        host, port = url.removeprefix("http://").split(":")
        data = json.dumps(body).encode()
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 10
        while not (model.calls and model.calls[0]["made"] >= 3) and time.monotonic() < deadline:
            time.sleep(0.02)
        sock.close()
        assert model.calls and model.calls[0]["closed"].wait(5), "the generation went on after its client left"
        assert model.calls[0]["made"] < 1000


def test_format_output_parses_and_follows_the_schema_streaming_or_not(served):
    """End to end: the random model would never write JSON unprompted; constrained, it must."""
    jsonschema = pytest.importorskip("jsonschema")
    url, _ = served
    client = _client(url)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    for options in ({"temperature": 0, "num_predict": 64}, {"temperature": 0.8, "seed": 3, "num_predict": 64}):
        r = client.chat(model="tiny", messages=MSG, format=schema, options=options)
        jsonschema.validate(json.loads(r.message.content), schema)
        parts = list(client.generate(model="tiny", prompt="x", format=schema, options=options, stream=True))
        jsonschema.validate(json.loads("".join(p.response for p in parts)), schema)
    plain = client.chat(model="tiny", messages=MSG, options={"temperature": 0, "num_predict": 64}).message.content
    assert not plain.lstrip().startswith("{")
    # any JSON object: the random model's keys may run past num_predict, but it is an object from the start
    any_json = client.chat(model="tiny", messages=MSG, format="json", options={"temperature": 0, "num_predict": 16})
    assert any_json.message.content.startswith('{"')


def test_logprobs_are_the_openai_surfaces_streaming_or_not(served):
    url, _ = served
    client = _client(url)
    options = {"temperature": 0, "num_predict": 8}
    oa = _openai(url).chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3).choices[0].logprobs.content
    r = client.chat(model="tiny", messages=MSG, options=options, logprobs=True, top_logprobs=3)
    assert len(r.logprobs) == len(oa) == 8
    for ours, theirs in zip(r.logprobs, oa):
        assert ours.token == theirs.token and abs(ours.logprob - theirs.logprob) < 1e-4
        assert [t.token for t in ours.top_logprobs] == [t.token for t in theirs.top_logprobs]
    assert "".join(p.token for p in r.logprobs) == r.message.content
    parts = list(client.generate(model="tiny", prompt=MSG[0]["content"], options=options, logprobs=True, stream=True))
    streamed = [p for part in parts for p in part.logprobs or []]
    assert [(p.token, p.logprob) for p in streamed] == [(p.token, p.logprob) for p in r.logprobs]
    assert all(not p.top_logprobs for p in streamed)  # top_logprobs not asked for
    assert client.chat(model="tiny", messages=MSG, options=options).logprobs is None
    bad = httpx.post(url + "/api/chat", json={"model": "tiny", "messages": MSG, "top_logprobs": 3, "stream": False})
    assert bad.status_code == 400 and "logprobs" in bad.json()["error"]


def test_an_error_after_the_stream_began_is_an_error_line(spec, monkeypatch):
    from mlxspec.errors import MlxspecError

    class Failing:
        def stream(self, prompt, request):
            yield Chunk(text="a", tokens=[1], stats=Stats())
            raise MlxspecError("the drafter broke")

    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=64))
    monkeypatch.setattr(app.state.server.worker, "spec", Failing())
    with running(app) as url:
        parts = _client(url).chat(model="tiny", messages=MSG, stream=True)
        assert next(parts).message.content == "a"
        with pytest.raises(ollama.ResponseError, match="the drafter broke"):
            next(parts)


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_drafter_the_model_cannot_run_is_a_400(served, path, stream):
    """The engine's refusal (no MTP head in this model) is the client's error, before the stream starts."""
    url, _ = served
    body = {"model": "tiny", **_what_to_answer(path), "stream": stream, "speculation": {"drafter": "mtp"}}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400 and "no MTP head" in r.json()["error"]
