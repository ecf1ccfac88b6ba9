"""`mlxspec serve`: the OpenAI surface through the official SDK, exactness through the server,
tools, errors, auth, limits, load, disconnects, a full queue, and schema fuzzing. A real
uvicorn server on 127.0.0.1 over a tiny offline model."""

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from mlxspec.api import load
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from mlxspec.server.tools import ToolCallParser
from server_helpers import running

MSG = [{"role": "user", "content": "def add(a, b): return a + b\ndef add(a, b):"}]


@pytest.fixture(scope="module")
def spec(tiny_qwen3):
    return load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def served(spec):
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=256, max_queue=64, max_body_bytes=64 * 1024))
    with running(app) as url:
        yield url, app


def _client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def _plain(spec, app, messages, n):
    ids = app.state.server.encode_chat(messages)
    return spec.generate(ids, max_tokens=n, temperature=0, drafter="none").text


def test_chat_at_temperature_zero_is_plain_decoding_streaming_or_not(spec, served):
    url, app = served
    client = _client(url)
    expected = _plain(spec, app, MSG, 24)
    for drafter in ("pld", "none", "auto"):
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=24, temperature=0,
                                           extra_body={"speculation": {"drafter": drafter}})
        assert r.choices[0].message.content == expected
        assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
        assert r.usage.model_extra["speculation"]["drafter"] in ("pld", "none", "draft", "mtp")
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 24


def test_speculation_override_and_usage(spec, served):
    url, _ = served
    client = _client(url)
    off = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=16, temperature=0,
                                         extra_body={"speculation": {"enabled": False}})
    assert off.usage.model_extra["speculation"] == {"drafter": "none", "drafted": 0, "accepted": 0, "tree_steps": 0,
                                                    "acceptance": None}
    bad = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "speculation": {"drafter": "magic"}})
    assert bad.status_code == 400 and "speculation.drafter" in bad.json()["error"]["message"]


def test_completions_stop_and_seed(spec, served):
    url, _ = served
    client = _client(url)
    prompt = "def add(a, b):\n    return"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    text = full.choices[0].text
    assert text == spec.generate(prompt, max_tokens=20, temperature=0, raw=True, drafter="none").text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert streamed == text
    stop = text[3:5]  # a stop string inside the output: cut before it, finish "stop"
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.9, seed=7)
            .choices[0].text for _ in range(2))
    assert a == b


def test_tools_reach_the_template_and_tool_calls_come_back(spec, served, monkeypatch):
    url, app = served
    server = app.state.server
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": parameters}}]
    # the random model never calls a tool: make the generation say a call, as a real model would
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = ["Let me check. ", call[:9], call[9:30], call[30:]]

    async def fake_generate(request, gen, outcome):
        seen["prompt"] = gen.prompt_ids
        for p in pieces:
            outcome.completion_tokens += 1
            yield p

    seen = {}
    monkeypatch.setattr(server, "generate", fake_generate)
    # the fixture's ChatML template ignores tools; Qwen3's real one renders them
    template = (Path(__file__).parent / "data" / "chat_templates" / "Qwen3-0.6B.jinja").read_text()
    monkeypatch.setattr(spec.tokenizer._tokenizer, "chat_template", template)
    client = _client(url)
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=tools, max_tokens=32)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Let me check. "
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    assert len(seen["prompt"]) > len(server.encode_chat(MSG))  # the tool schema went into the prompt
    stream = list(client.chat.completions.create(model="tiny", messages=MSG, tools=tools, max_tokens=32, stream=True))
    calls = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Let me check. "
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # the round trip: the assistant's call and the tool's answer go back through the template
    monkeypatch.setattr(server, "generate", type(server).generate.__get__(server))
    follow = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, tools=tools, messages=MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": tc.id, "type": "function", "function": {
            "name": "get_weather", "arguments": tc.function.arguments}}]},
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temp": 21}'}])
    assert follow.choices[0].finish_reason in ("length", "stop")


def test_tool_call_parser_holds_back_only_a_possible_tag():
    p = ToolCallParser()
    assert p.feed("hello <tool") == ["hello "]
    assert p.feed("_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> bye") [1:] == [" bye"]
    assert p.feed("<tool_call>not json</tool_call>") == ["<tool_call>not json</tool_call>"]
    assert p.feed("<tool_call>{\"name\"") == [] and p.finish() == ['<tool_call>{"name"']


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "not valid JSON"),
    ('{"messages": "hi"}', 400, "messages"),
    ('{"messages": [], "max_tokens": 4}', 400, "must not be empty"),
    ('{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}', 404, "serves 'tiny'"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400, "cap of 256"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temperature"),
    ('{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
    # what a template would render as nothing, or a part of the prompt left out unseen
    ('{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role must be one of"),
    ('{"messages": [{"role": "function", "content": "x"}]}', 400, "messages.0.role must be one of"),
    ('{"messages": [{"role": "user", "content": null}]}', 400, "messages.0.content must be"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400,
     "content part type 'image_url' is not supported"),
    ('{"messages": [{"role": "user", "content": [{"text": "x"}]}]}', 400, "content part type None"),
    ('{"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]}', 400, "'refusal'"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', 400,
     "tools.0.function must be an object with a string name"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom", "custom": {"name": "f"}}]}', 400,
     "tools.0.type"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f", "parameters": []}}]}',
     400, "tools.0.function.parameters must be a JSON schema object"),
])
def test_bad_requests_get_openai_shaped_4xx(served, body, status, needle):
    url, _ = served
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and "Traceback" not in r.text


def test_the_developer_role_is_the_system_prompt_and_an_assistant_may_refuse_in_parts(spec, served):
    """OpenAI's newer clients send "developer" where "system" was: the template gets a system
    message (left as "developer", a Qwen template writes a turn of a role its model never saw);
    an assistant's refusal part is its text. The planted "developer" -> "developer" gives the
    prompt one token more and fails."""
    url, app = served
    turns = [{"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}, MSG[0]]
    system = [{"role": "system", "content": "Answer in Python."}, *turns]
    expected = _plain(spec, app, [system[0], {"role": "assistant", "content": "No."}, MSG[0]], 8)
    prompt_tokens = {}
    for role in ("developer", "system"):
        r = _client(url).chat.completions.create(model="tiny", messages=[{**system[0], "role": role}, *turns],
                                                 max_tokens=8, temperature=0)
        assert r.choices[0].message.content == expected, role
        prompt_tokens[role] = r.usage.prompt_tokens
    plain = _client(url).chat.completions.create(model="tiny", messages=turns, max_tokens=8, temperature=0)
    assert prompt_tokens["developer"] == prompt_tokens["system"] > plain.usage.prompt_tokens, prompt_tokens


def test_oversized_body_and_unknown_path(served):
    url, _ = served
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 100_000}]})
    assert r.status_code == 413 and "over" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing").status_code == 404


def test_models_health_metrics(served):
    url, _ = served
    assert [m.id for m in _client(url).models.list()] == ["tiny"]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    text = httpx.get(url + "/metrics").text
    for name in ("mlxspec_requests_total", "mlxspec_completion_tokens_total", "mlxspec_acceptance_ratio",
                 "mlxspec_queue_depth"):
        assert name in text
    assert httpx.get(url + "/openapi.json").json()["paths"]["/v1/chat/completions"]


def test_api_key(spec):
    app = create_app(spec, Settings(model_name="tiny", api_key="s3cret"))
    with running(app) as url:
        with pytest.raises(openai.AuthenticationError):
            _client(url, api_key="wrong").models.list()
        assert _client(url, api_key="s3cret").models.list().data[0].id == "tiny"
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # probes need no key


def test_concurrent_streams_all_complete_and_equal_serial_runs(spec, served):
    url, app = served
    prompts = [[{"role": "user", "content": f"item {i}: def f{i}(x): return x * {i}\n"}] for i in range(8)]
    expected = [_plain(spec, app, p, 12) for p in prompts]

    async def one(client, i):
        text = ""
        async with client.stream("POST", url + "/v1/chat/completions", json={
                "messages": prompts[i % 8], "max_tokens": 12, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += chunk["choices"][0]["delta"].get("content") or "" if chunk["choices"] else ""
        return text

    async def all_of_them():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert results == [expected[i % 8] for i in range(32)]


def test_disconnect_frees_the_worker(spec, served):
    url, app = served
    server = app.state.server
    before = server.metrics.completion_tokens
    with httpx.stream("POST", url + "/v1/completions", json={
            "prompt": "x", "max_tokens": 256, "temperature": 0.8, "stream": True}, timeout=60) as r:
        for _ in zip(r.iter_lines(), range(3)):
            pass
    deadline = time.monotonic() + 20
    while server.worker.depth and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.worker.depth == 0
    assert server.metrics.completion_tokens - before < 256  # stopped early, not run to the end
    r = _client(url).completions.create(model="tiny", prompt="y", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


class _Slow:
    """The model, but each chunk takes 50 ms: generations outlast the test's requests."""

    def __init__(self, spec):
        self._spec = spec

    def __getattr__(self, name):
        return getattr(self._spec, name)

    def stream(self, *args, **kwargs):
        for chunk in self._spec.stream(*args, **kwargs):
            time.sleep(0.05)
            yield chunk


def test_full_queue_answers_503_with_retry_after(spec):
    app = create_app(_Slow(spec), Settings(model_name="tiny", max_queue=1))
    with running(app) as url:
        body = {"prompt": "x", "max_tokens": 20, "temperature": 0, "speculation": {"enabled": False}}
        results = []

        def post():
            results.append(httpx.post(url + "/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)  # one running, one waiting
        busy = httpx.post(url + "/v1/completions", json=body, timeout=120)
        for t in threads:
            t.join()
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "overloaded_error"
        assert [r.status_code for r in results] == [200, 200]


def test_schema_fuzzing_finds_no_server_errors(served):
    """Bodies generated from the served OpenAPI schema (valid and not): never a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    url, _ = served
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures, calls = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def check(case):
            nonlocal calls
            if isinstance(case.body, dict):  # bounded work per case
                case.body["max_tokens"] = 2
                case.body.pop("max_completion_tokens", None)
                case.body["stream"] = False
            response = case.call(base_url=url, timeout=60)
            calls += 1
            if response.status_code >= 500:
                failures.append((operation.path, case.body, response.status_code, response.text[:200]))

        check()
    assert calls > 40
    assert not failures, failures[:3]


def test_serve_refuses_public_bind_without_key():
    r = subprocess.run([sys.executable, "-m", "mlxspec", "serve", "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and "without an API key" in r.stderr


def test_served_text_equals_mlxspec_run(tiny_qwen3, served):
    """Exactness through the server: the same chat at temperature 0 as `mlxspec run` prints."""
    from typer.testing import CliRunner

    from mlxspec import cli

    url, _ = served
    prompt = MSG[0]["content"]
    ran = CliRunner().invoke(cli.app, ["run", str(tiny_qwen3), prompt, "--temp", "0", "--max-tokens", "20",
                                       "--json", "--drafter", "pld"])
    assert ran.exit_code == 0, ran.output
    served_text = _client(url).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=20, temperature=0).choices[0].message.content
    assert served_text == json.loads(ran.stdout)["text"]


def test_bad_logprobs_are_refused_not_ignored(served):
    url, _ = served
    for body in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}, {"logprobs": 3}):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("logprobs", "top_logprobs"), body


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/messages", {"model": "tiny", "messages": MSG, "max_tokens": 2}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_drafter_the_model_cannot_run_is_a_400_on_every_surface(served, path, body, stream):
    """The engine's refusal (no MTP head in this model) is the client's error, never a 500."""
    url, _ = served
    r = httpx.post(url + path, json={**body, "stream": stream, "speculation": {"drafter": "mtp"}})
    assert r.status_code == 400 and "no MTP head" in r.text
