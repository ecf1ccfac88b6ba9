"""`/v1/responses` (the OpenAI Responses API) through the official SDK: text and streaming at
temperature 0 equal to chat completions', previous_response_id, function tools, json_schema
output, reasoning effort, errors in OpenAI's shape, and a cancelled stream freeing the worker.
A real uvicorn server on 127.0.0.1 over a tiny offline model."""

import json
from pathlib import Path

import httpx
import openai
import pytest

from mlxspec.api import load
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from mlxspec.server.responses import ResponseStore
from server_helpers import running, until

TEXT = "def add(a, b): return a + b\ndef add(a, b):"
MSG = [{"role": "user", "content": TEXT}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"}},
          "required": ["city", "rain"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def spec(tiny_qwen3):
    return load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def served(spec):
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=256, max_queue=8))
    with running(app) as url:
        yield url, app


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _chat(client, messages, n, **kw):
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0, **kw)
    return r.choices[0].message.content


def test_text_equals_chat_completions_at_temperature_zero(served):
    url, _ = served
    client = _client(url)
    expected = _chat(client, [{"role": "system", "content": "Be brief."}] + MSG, 16)
    r = client.responses.create(model="tiny", input=TEXT, instructions="Be brief.", max_output_tokens=16,
                                temperature=0)
    assert r.output_text == expected and r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 16 and r.usage.total_tokens == r.usage.input_tokens + 16
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert set(r.usage.model_extra["speculation"]) >= {"drafter", "drafted", "accepted"}
    # input as message items, developer as system, content as input_text parts
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TEXT}]}]
    assert client.responses.create(model="tiny", input=items, max_output_tokens=16, temperature=0).output_text \
        == expected


def test_streaming_events_carry_the_same_text(served):
    url, _ = served
    client = _client(url)
    expected = _chat(client, MSG, 12)
    events = list(client.responses.create(model="tiny", input=TEXT, max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    final = events[-1].response
    assert final.output_text == expected and final.usage.output_tokens == 12
    with client.responses.stream(model="tiny", input=TEXT, max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected


def test_the_stream_helper_gives_the_final_response(served, monkeypatch):
    url, app = served

    async def fake_generate(request, gen, outcome):
        for piece in ["Hello", ", ", "world"]:
            outcome.completion_tokens += 1
            yield piece

    monkeypatch.setattr(app.state.server, "generate", fake_generate)
    with _client(url).responses.stream(model="tiny", input="hi") as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "Hello, world"
    assert final.usage.output_tokens == 3


def test_previous_response_id_continues_the_conversation(served):
    url, _ = served
    client = _client(url)
    first = client.responses.create(model="tiny", input=TEXT, max_output_tokens=8, temperature=0)
    second = client.responses.create(model="tiny", input="and again", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    history = MSG + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "and again"}]
    assert second.output_text == _chat(client, history, 8)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    # not stored: nothing to continue
    unkept = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    for rid in (unkept.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="tiny", input="x", previous_response_id=rid, max_output_tokens=2)
    r = httpx.post(url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    error = r.json()["error"]
    assert r.status_code == 404 and set(error) == {"message", "type", "param", "code"}
    assert "resp_nope" in error["message"] and error["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_the_store_is_bounded():
    store = ResponseStore(limit=2)
    for rid in ("a", "b", "c"):
        store.put({"id": rid}, [])
    assert list(store.kept) == ["b", "c"]


def test_a_function_tool_round_trip(served, spec, monkeypatch):
    url, app = served
    server, seen = app.state.server, {}

    async def fake_generate(request, gen, outcome):
        seen["prompt"] = spec.tokenizer.decode(gen.prompt_ids)
        for piece in ["Checking. ", CALL[:12], CALL[12:]]:
            outcome.completion_tokens += 1
            yield piece

    template = (Path(__file__).parent / "data" / "chat_templates" / "Qwen3-0.6B.jinja").read_text()
    monkeypatch.setattr(spec.tokenizer._tokenizer, "chat_template", template)
    monkeypatch.setattr(server, "generate", fake_generate)
    client = _client(url)
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER])
    assert "get_weather" in seen["prompt"]  # the tool reached the template
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == \
        {"city": "Paris"}
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], stream=True))
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [call.arguments]
    # the tool's output goes back, by previous_response_id or as input items
    out = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    client.responses.create(model="tiny", previous_response_id=r.id, input=[out], tools=[WEATHER])
    assert '{"temp": 21}' in seen["prompt"] and seen["prompt"].count("get_weather") >= 2
    by_hand = seen["prompt"]
    client.responses.create(model="tiny", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        out])
    assert seen["prompt"] == by_hand
    monkeypatch.setattr(server, "generate", type(server).generate.__get__(server))
    follow = client.responses.create(model="tiny", previous_response_id=r.id, input=[out], tools=[WEATHER],
                                     max_output_tokens=4, temperature=0)
    assert follow.usage.output_tokens == 4


def test_reasoning_comes_back_as_a_reasoning_item(served, monkeypatch):
    url, app = served

    async def fake_generate(request, gen, outcome):
        for piece in ["<think>", "adding numbers", "</think>", "Four"]:
            outcome.completion_tokens += 1
            yield piece

    monkeypatch.setattr(app.state.server, "generate", fake_generate)
    client = _client(url)
    r = client.responses.create(model="tiny", input="2 + 2?")
    thought, message = r.output
    assert thought.type == "reasoning" and thought.content[0].text == "adding numbers"
    assert r.output_text == "Four" and 0 < r.usage.output_tokens_details.reasoning_tokens <= 4
    events = list(client.responses.create(model="tiny", input="2 + 2?", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "adding numbers"
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
    # sent back, it is the assistant turn's reasoning
    seen = {}

    async def prompt_of(request, gen, outcome):
        seen["ids"] = gen.prompt_ids
        yield "ok"

    monkeypatch.setattr(app.state.server, "generate", prompt_of)
    client.responses.create(model="tiny", previous_response_id=r.id, input="and 3 + 3?")
    assert seen["ids"] == app.state.server.encode_chat([
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "Four", "reasoning_content": "adding numbers"},
        {"role": "user", "content": "and 3 + 3?"}])


def test_json_schema_output_parses(served):
    url, _ = served
    r = _client(url).responses.create(model="tiny", input="the weather?", max_output_tokens=60, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA,
                                                       "strict": True}})
    value = json.loads(r.output_text)
    assert set(value) == {"city", "rain"} and r.status == "completed"


def test_reasoning_effort_maps_to_the_reasoning_mode(served):
    url, _ = served
    client = _client(url)
    expected = _chat(client, MSG, 8, reasoning_effort="none")
    r = client.responses.create(model="tiny", input=TEXT, max_output_tokens=8, temperature=0,
                                reasoning={"effort": "none", "summary": "auto"})
    assert r.output_text == expected and r.reasoning.effort == "none"


@pytest.mark.parametrize("body, status, needle", [
    ({"input": "x", "temperatur": 0}, 400, "temperatur"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input_image"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "web_search"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, 400, "reasoning.effort"),
    ({"input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": []}, 400, "input must not be empty"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include.0"),
    ({"model": "gpt-5", "input": "x"}, 404, "serves 'tiny'"),
])
def test_bad_requests_are_openai_shaped_4xx(served, body, status, needle):
    url, _ = served
    r = httpx.post(url + "/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_fields_accepted_with_no_effect(served):
    url, _ = served
    r = httpx.post(url + "/v1/responses", json={
        "input": "x", "max_output_tokens": 2, "user": "u", "metadata": {"a": "b"}, "store": False,
        "service_tier": "auto", "truncation": "disabled", "include": ["reasoning.encrypted_content"],
        "text": {"format": {"type": "text"}, "verbosity": "low"}, "parallel_tool_calls": True})
    assert r.status_code == 200 and r.json()["metadata"] == {"a": "b"}


def test_a_cancelled_stream_frees_the_worker(served):
    url, app = served
    server = app.state.server
    before = server.metrics.completion_tokens
    with httpx.stream("POST", url + "/v1/responses", json={
            "input": "x", "max_output_tokens": 256, "temperature": 0.8, "stream": True}, timeout=60) as r:
        for _ in zip(r.iter_lines(), range(12)):
            pass
    assert until(lambda: server.worker.depth == 0, 20)
    assert server.metrics.completion_tokens - before < 256  # stopped early, not run to the end
    # temperature 0: at the Responses default (1.0) the tiny model stops within 4 tokens 0.29% of the time
    after = _client(url).responses.create(model="tiny", input="y", max_output_tokens=4, temperature=0)
    assert after.usage.output_tokens == 4


def test_the_api_key_guards_responses_as_chat(spec):
    app = create_app(spec, Settings(model_name="tiny", api_key="s3cret", max_tokens_cap=8))
    with running(app) as url:
        r = httpx.post(url + "/v1/responses", json={"input": "x", "max_output_tokens": 2})
        assert r.status_code == 401 and "message" in r.json()["error"]
        ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.responses.create(model="tiny", input="x", max_output_tokens=2).usage.output_tokens == 2
