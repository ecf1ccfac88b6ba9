"""The OpenAI surface's logprobs and constrained output, with speculation on, through the
unmodified openai SDK: logprobs equal speculation off, JSON schemas validate, regexes and
forced tool calls hold, drafters still draft."""

import json

import httpx
import jsonschema
import openai
import pytest

from mlxspec.api import load
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running

MSG = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog, the quick brown fox"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "rain", "days"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(tiny_qwen3, tiny_qwen3_draft):
    spec = load(str(tiny_qwen3), draft_model=str(tiny_qwen3_draft))
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=256))
    with running(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), url


def _speculation(drafter):
    return {"speculation": {"drafter": drafter, "depth": 3}}


def _content_logprobs(choice):
    return [(p.token, p.logprob, [(t.token, t.logprob) for t in p.top_logprobs]) for p in choice.logprobs.content]


def _close(a, b):
    assert [x[0] for x in a] == [x[0] for x in b]
    for (_, lp_a, top_a), (_, lp_b, top_b) in zip(a, b):
        assert abs(lp_a - lp_b) < 1e-4
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(top_a, top_b))


def test_chat_logprobs_equal_speculation_off_streaming_or_not(served):
    client, _ = served
    kw = dict(model="tiny", messages=MSG, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3)
    off = client.chat.completions.create(**kw, extra_body=_speculation("none"))
    expected = _content_logprobs(off.choices[0])
    assert len(expected) == 20 and all(len(top) == 3 for _, _, top in expected)
    assert all(top[0][1] >= lp - 1e-6 for _, lp, top in expected)  # the chosen token is the top one at temperature 0
    for drafter in ("pld", "draft"):
        on = client.chat.completions.create(**kw, extra_body=_speculation(drafter))
        assert on.choices[0].message.content == off.choices[0].message.content
        assert on.usage.model_extra["speculation"]["drafted"] > 0
        _close(_content_logprobs(on.choices[0]), expected)
        chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=_speculation(drafter)))
        streamed = [p for c in chunks if c.choices and c.choices[0].logprobs
                    for p in c.choices[0].logprobs.content]
        _close([(p.token, p.logprob, [(t.token, t.logprob) for t in p.top_logprobs]) for p in streamed], expected)
        assert [p.bytes for p in streamed] == [p.bytes for p in off.choices[0].logprobs.content]
    plain = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_integer(served):
    client, _ = served
    kw = dict(model="tiny", prompt="the quick brown fox", max_tokens=12, temperature=0, logprobs=2)
    off = client.completions.create(**kw, extra_body=_speculation("none")).choices[0]
    on = client.completions.create(**kw, extra_body=_speculation("pld")).choices[0]
    assert on.text == off.text and on.logprobs.tokens == off.logprobs.tokens
    assert len(off.logprobs.token_logprobs) == 12 and all(len(t) <= 2 for t in off.logprobs.top_logprobs)
    assert all(abs(a - b) < 1e-4 for a, b in zip(on.logprobs.token_logprobs, off.logprobs.token_logprobs))
    assert off.logprobs.text_offset[0] == 0 and off.logprobs.text_offset[1] == len(off.logprobs.tokens[0])
    chunks = list(client.completions.create(**kw, stream=True, extra_body=_speculation("pld")))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == off.logprobs.tokens


def test_logprobs_end_where_a_stop_string_cuts_the_text(served):
    """The tokens whose text a stop string cut away get no logprobs, streamed or not."""
    client, _ = served
    kw = dict(model="tiny", messages=MSG, max_tokens=20, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**kw).choices[0]
    tokens = [p.token for p in whole.logprobs.content]
    # a stop string two tokens long whose first occurrence starts at token i > 0
    i = next(i for i in range(1, len(tokens) - 1)
             if whole.message.content.find("".join(tokens[i:i + 2])) == len("".join(tokens[:i])))
    stop = "".join(tokens[i:i + 2])
    cut = client.chat.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.message.content == "".join(tokens[:i]) and cut.finish_reason == "stop"
    assert [p.token for p in cut.logprobs.content] == tokens[:i]
    chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True))
    streamed = [p.token for c in chunks if c.choices and c.choices[0].logprobs for p in c.choices[0].logprobs.content]
    assert streamed == tokens[:i]


@pytest.mark.parametrize("drafter", ["none", "pld", "draft"])
def test_json_schema_response_format_validates(served, drafter):
    client, _ = served
    free = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=20, temperature=0)
    with pytest.raises(json.JSONDecodeError):  # the model does not write JSON unprompted
        json.loads(free.choices[0].message.content)
    for temperature in (0, 0.8):
        for seed in range(3):
            r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, temperature=temperature,
                                               seed=seed, response_format=RESPONSE_FORMAT,
                                               extra_body=_speculation(drafter))
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            assert r.choices[0].finish_reason == "stop"


def test_constrained_output_keeps_drafting(served):
    client, _ = served
    messages = [{"role": "user", "content": 'Answer {"city": "Paris", "rain": true, "days": 3} like '
                                           '{"city": "Paris", "rain": true, "days": 3}'}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                       response_format=RESPONSE_FORMAT, extra_body=_speculation("pld"))
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    spec = r.usage.model_extra["speculation"]
    assert spec["drafter"] == "pld" and spec["accepted"] > 0
    off = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                         response_format=RESPONSE_FORMAT, extra_body=_speculation("none"))
    assert off.choices[0].message.content == r.choices[0].message.content


def test_json_object_and_regex(served):
    client, _ = served
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=24, temperature=0,
                                       extra_body={"guided_regex": "(red|green|blue)-[0-9]{3}"})
    text = r.choices[0].message.content
    assert text.split("-")[0] in ("red", "green", "blue") and len(text.split("-")[1]) == 3
    r = client.completions.create(model="tiny", prompt="x", max_tokens=24, temperature=0,
                                  extra_body={"guided_grammar": 'start: "up" | "down"',
                                              "speculation": {"drafter": "pld"}})
    assert r.choices[0].text in ("up", "down")
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=80, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_makes_a_call(served, choice, stream):
    client, _ = served
    kw = dict(model="tiny", messages=MSG, max_tokens=150, temperature=0, tools=[WEATHER, TIME], tool_choice=choice,
              extra_body=_speculation("pld"))
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = r.choices[0].message.tool_calls
    else:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_weather"
    if calls[0].function.name == "get_weather":
        assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"guided_regex": "[0-9"}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_shaped_400s(served, body, param, stream):
    _, url = served
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "stream": stream, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    if param:
        assert error["param"] == param
