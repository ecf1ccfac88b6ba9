"""The Anthropic Messages surface, driven by the official ``anthropic`` SDK against a real uvicorn."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import pytest

from mlxspec import api
from mlxspec.server import anthropic as surface
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running

KEY = "x"
N = 16
HELLO = [{"role": "user", "content": "Hello"}]
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}


@pytest.fixture(scope="module")
def spec(tiny_qwen3):
    return api.load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def app(spec):
    return create_app(spec, Settings(model_name="tiny", api_key=KEY, max_tokens_cap=64))


@pytest.fixture(scope="module")
def base_url(app):
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)


def greedy(speculation=None) -> dict:
    """Extra body fields: this SDK has no temperature argument (the server defaults to 1.0)."""
    return {"temperature": 0, **({"speculation": speculation} if speculation else {})}


def plain(spec, app, messages, tools=None, n=N):
    """What plain greedy decoding (no drafter) writes for these chat messages."""
    ids = app.state.server.encode_chat(messages, tools)
    return ids, spec.generate(ids, max_tokens=n, temperature=0, drafter="none")


def post(base_url, path, body, key=KEY, raw: bytes | None = None):
    """(status, parsed JSON or SSE text) of a raw POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    if key:
        headers["x-api-key"] = key
    req = urllib.request.Request(base_url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, ctype, text = resp.status, resp.headers.get("content-type", ""), resp.read().decode()
    except urllib.error.HTTPError as err:
        status, ctype, text = err.code, err.headers.get("content-type", ""), err.read().decode()
    return status, (json.loads(text) if ctype.startswith("application/json") else text)


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# -- generation ----------------------------------------------------------------------------

def test_greedy_equals_plain_decoding_for_every_drafter(client, spec, app):
    ids, ref = plain(spec, app, HELLO)
    for speculation in ({"enabled": False}, {"drafter": "pld"}, None):
        msg = client.messages.create(model="tiny", max_tokens=N, messages=HELLO, extra_body=greedy(speculation))
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert msg.model == "tiny"
        assert text_of(msg) == ref.text
        assert msg.usage.input_tokens == len(ids)
        assert msg.usage.output_tokens == len(ref.tokens)
        assert msg.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
        assert msg.stop_sequence is None


def test_speculation_overrides_show_in_usage(client):
    off = client.messages.create(model="tiny", max_tokens=N, messages=HELLO,
                                 extra_body=greedy({"enabled": False}))
    assert off.usage.speculation["drafted"] == 0
    assert off.usage.speculation["drafter"] == "none"
    pld = client.messages.create(model="tiny", max_tokens=N, messages=HELLO,
                                 extra_body=greedy({"drafter": "pld", "depth": 3}))
    assert pld.usage.speculation["drafter"] == "pld"


def test_sdk_stream_matches_non_streaming(client, spec, app):
    _, ref = plain(spec, app, HELLO)
    with client.messages.stream(model="tiny", max_tokens=N, extra_body=greedy(), messages=HELLO) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert text_of(final) == ref.text
    assert final.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn")
    assert final.usage.output_tokens == len(ref.tokens)


def test_raw_sse_event_order(base_url, spec, app):
    ids, ref = plain(spec, app, HELLO)
    status, text = post(base_url, "/v1/messages", {"model": "tiny", "max_tokens": N, "temperature": 0,
                                                   "messages": HELLO, "stream": True})
    assert status == 200
    events = sse_events(text)
    for name, data in events:
        assert data["type"] == name
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    body = names[2:-2]
    if ref.text:
        assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
        assert set(body[1:-1]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == len(ids) and start["stop_reason"] is None
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(deltas) == ref.text
    end = events[-2][1]
    assert end["delta"]["stop_reason"] in ("max_tokens", "end_turn")
    assert end["usage"]["output_tokens"] == len(ref.tokens)
    assert end["usage"]["speculation"]["drafter"] in api.DRAFTERS


def test_system_prompt_string_and_blocks(client, spec, app):
    system = "You are terse."
    ids, ref = plain(spec, app, [{"role": "system", "content": system}] + HELLO)
    for sys in (system, [{"type": "text", "text": system}]):
        msg = client.messages.create(model="tiny", max_tokens=N, extra_body=greedy(), system=sys, messages=HELLO)
        assert msg.usage.input_tokens == len(ids)
        assert text_of(msg) == ref.text
    assert client.messages.count_tokens(model="tiny", system=system, messages=HELLO).input_tokens == len(ids)


def test_stop_sequences(client, spec, app):
    messages = [{"role": "user", "content": "Tell me about speculative decoding."}]
    _, ref = plain(spec, app, messages)
    if len(ref.text) < 4:
        pytest.skip("the random model wrote too little to stop inside")
    stop = ref.text[2:4]
    msg = client.messages.create(model="tiny", max_tokens=N, extra_body=greedy(), messages=messages,
                                 stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert text_of(msg) == ref.text[: ref.text.find(stop)]
    with client.messages.stream(model="tiny", max_tokens=N, extra_body=greedy(), messages=messages,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert text_of(final) == ref.text[: ref.text.find(stop)]


def test_count_tokens(client, app):
    server = app.state.server
    assert client.messages.count_tokens(model="tiny", messages=HELLO).input_tokens == len(server.encode_chat(HELLO))


def test_assistant_prefill_continues_the_text(client, spec, app):
    ids = app.state.server.encode_chat(HELLO) + list(spec.tokenizer.encode("Sure", add_special_tokens=False))
    ref = spec.generate(ids, max_tokens=8, temperature=0, drafter="none")
    msg = client.messages.create(model="tiny", max_tokens=8, extra_body=greedy(),
                                 messages=HELLO + [{"role": "assistant", "content": "Sure"}])
    assert msg.usage.input_tokens == len(ids)
    assert text_of(msg) == ref.text


# -- tools -----------------------------------------------------------------------------------

@pytest.fixture
def fake_tool_call(app, monkeypatch):
    """The model 'writes' a tool call (a random tiny model never does by itself)."""
    server = app.state.server
    seen = []

    async def generate(request, gen, outcome):
        seen.append(gen)
        text = "Let me check.\n\n" + WEATHER_CALL + "\n"
        for i in range(0, len(text), 5):  # tags split across deltas
            outcome.completion_tokens += 1
            outcome.text += text[i:i + 5]
            yield text[i:i + 5]
        outcome.finish_reason = "stop"

    monkeypatch.setattr(server, "generate", generate)
    return seen


def test_tool_use_non_streaming(client, fake_tool_call):
    msg = client.messages.create(model="tiny", max_tokens=N, tools=[WEATHER_TOOL],
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Let me check."
    call = msg.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    assert msg.stop_reason == "tool_use"


def test_tool_use_streaming(client, base_url, fake_tool_call):
    status, text = post(base_url, "/v1/messages", {"model": "tiny", "max_tokens": N, "stream": True,
                                                   "tools": [WEATHER_TOOL],
                                                   "messages": [{"role": "user", "content": "Weather?"}]})
    assert status == 200
    events = sse_events(text)
    names = [n for n, _ in events]
    n_text = sum(1 for n, d in events if n == "content_block_delta" and d["index"] == 0)
    assert names == (["message_start", "ping", "content_block_start"] + ["content_block_delta"] * n_text
                     + ["content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                        "message_delta", "message_stop"])
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta"
                   and d["index"] == 0) == "Let me check."
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1]
    tool_start = starts[1]["content_block"]
    assert tool_start["name"] == "get_weather" and tool_start["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["index"] == 1)
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in events
               if n == "content_block_delta" and d["index"] == 1)
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    with client.messages.stream(model="tiny", max_tokens=N, tools=[WEATHER_TOOL],
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    assert final.content[-1].type == "tool_use" and final.content[-1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_tool_choice_none_keeps_the_text(client, fake_tool_call):
    msg = client.messages.create(model="tiny", max_tokens=N, tools=[WEATHER_TOOL], tool_choice={"type": "none"},
                                 messages=[{"role": "user", "content": "Weather?"}])
    assert [b.type for b in msg.content] == ["text"] and "<tool_call>" in msg.content[0].text
    assert msg.stop_reason == "end_turn"


FOLLOW_UP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"},
        {"type": "text", "text": "Thanks"}]},
]
FOLLOW_UP_TEMPLATE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [{"type": "function", "id": "toolu_1",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
    {"role": "user", "content": "Thanks"},
]


def test_tool_result_follow_up_goes_through_the_template(client, spec, app):
    body = surface.MessagesBody(model="tiny", max_tokens=N, system="Be brief.", messages=FOLLOW_UP,
                                tools=[WEATHER_TOOL])
    assert surface.template_messages(body) == FOLLOW_UP_TEMPLATE
    tools = surface.template_tools(body)
    assert tools == [{"type": "function", "function": {"name": "get_weather",
                                                       "description": WEATHER_TOOL["description"],
                                                       "parameters": WEATHER_TOOL["input_schema"]}}]
    ids, ref = plain(spec, app, FOLLOW_UP_TEMPLATE, tools)
    msg = client.messages.create(model="tiny", max_tokens=N, extra_body=greedy(), system="Be brief.",
                                 tools=[WEATHER_TOOL], messages=FOLLOW_UP)
    assert msg.usage.input_tokens == len(ids)
    assert text_of(msg) == ref.text


async def _collect(deltas, tools):
    async def gen():
        for d in deltas:
            yield d
    return [e async for e in surface.content_events(gen(), tools)]


def test_content_events_whitespace_only_answer_is_kept():
    import asyncio

    events = asyncio.run(_collect(["\n", " "], True))
    assert [n for n, _ in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert events[1][1]["delta"]["text"] == "\n "
    unparsed = asyncio.run(_collect(["a<tool_", "call>x"], False))
    assert "".join(d["delta"]["text"] for n, d in unparsed if n == "content_block_delta") == "a<tool_call>x"


# -- errors ----------------------------------------------------------------------------------

def _anthropic_error(body, kind):
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]


@pytest.mark.parametrize("body, raw, status, kind, mentions", [
    ({"model": "gpt-4", "max_tokens": 4, "messages": HELLO}, None, 404, "not_found_error", "tiny"),
    ({"model": "tiny", "max_tokens": 4, "messages": []}, None, 400, "invalid_request_error", "messages"),
    ({"model": "tiny", "messages": HELLO}, None, 400, "invalid_request_error", "max_tokens"),
    (None, b'{"model": "tiny", "max_tokens": ', 400, "invalid_request_error", "JSON"),
    ({"model": "tiny", "max_tokens": 65, "messages": HELLO}, None, 400, "invalid_request_error", "cap"),
    ({"model": "tiny", "max_tokens": 0, "messages": HELLO}, None, 400, "invalid_request_error", "max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "temperature": 1.5, "messages": HELLO}, None, 400,
     "invalid_request_error", "temperature"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, None, 400,
     "invalid_request_error", "role"),
    ({"model": "tiny", "max_tokens": 4, "messages": HELLO, "speculation": {"drafter": "magic"}}, None, 400,
     "invalid_request_error", "drafter"),
    ({"model": "tiny", "max_tokens": 4, "stream": True, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, None, 400,
     "invalid_request_error", "image"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, None, 400,
     "invalid_request_error", "messages.0.content: a text block needs its text"),
    ({"model": "tiny", "max_tokens": 4, "system": [{"type": "text"}], "messages": HELLO}, None, 400,
     "invalid_request_error", "system: a text block needs its text"),
    ({"model": "tiny", "max_tokens": 4, "messages": HELLO, "stop_sequences": ["\n", ""]}, None, 400,
     "invalid_request_error", "stop_sequences.1 is empty"),
    ({"model": "tiny", "max_tokens": 4, "messages": HELLO, "tools": [{"name": "f"}, {"name": " "}]}, None, 400,
     "invalid_request_error", "tools.1.name must not be empty"),
])
def test_errors_are_anthropic_shaped(base_url, body, raw, status, kind, mentions):
    got, answer = post(base_url, "/v1/messages", body, raw=raw)
    assert got == status, answer
    _anthropic_error(answer, kind)
    assert mentions in answer["error"]["message"]


def test_auth_and_sdk_errors(base_url, client):
    status, answer = post(base_url, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HELLO},
                          key="wrong")
    assert status == 401
    _anthropic_error(answer, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="no-such-model", max_tokens=4, messages=HELLO)
    assert "tiny" in str(err.value)
    status, answer = post(base_url, "/v1/messages/count_tokens", {"model": "tiny", "messages": []})
    assert status == 400
    _anthropic_error(answer, "invalid_request_error")


def test_client_disconnect_cancels_the_generation(app, base_url, monkeypatch):
    import http.client
    import threading
    import time

    from mlxspec.engine.stats import Stats

    worker = app.state.server.worker
    made, closed = [], threading.Event()

    class Slow:
        def stream(self, **kwargs):
            try:
                for _ in range(kwargs["request"].max_tokens):
                    time.sleep(0.05)
                    made.append(1)
                    yield api.Chunk(text="a", tokens=[1], stats=Stats())
            finally:
                closed.set()

    monkeypatch.setattr(worker, "spec", Slow())
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=30)
    conn.request("POST", "/v1/messages", json.dumps({"model": "tiny", "max_tokens": 64, "stream": True,
                                                     "messages": HELLO}),
                 {"content-type": "application/json", "x-api-key": KEY})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"event: message_start")
    resp.close()  # the socket goes with the response
    conn.close()
    assert closed.wait(10), "the generation was not stopped"
    assert len(made) < 32
    deadline = time.monotonic() + 5
    while worker.depth and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.depth == 0
