"""A hostile client against the server: malformed tool_choice, JSON nested deep, lone
surrogates, floods of stop strings, sampling values at the edges. Each is a 4xx in the
surface's error shape, never a 500, and the kept-alive connection serves the next request."""

from __future__ import annotations

import http.client
import json
import random
import time

import httpx
import pytest

from mlxspec.api import load
from mlxspec.options import MAX_JSON_DEPTH, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_TEMPERATURE, MIN_TOP_P
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from mlxspec.server.generation import held_back
from server_helpers import running

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"messages": MSG, "max_tokens": 2, "temperature": 0}
COMPLETION = {"prompt": "x", "max_tokens": 2, "temperature": 0}
MESSAGES = {"model": "tiny", "messages": MSG, "max_tokens": 2}
COUNT = {"model": "tiny", "messages": MSG}
OLLAMA_CHAT = {"model": "tiny", "messages": MSG, "stream": False, "options": {"num_predict": 2}}
OLLAMA_GENERATE = {"model": "tiny", "prompt": "x", "stream": False, "options": {"num_predict": 2}}
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SURROGATE = "a\ud800b"


def deep(n: int = 500):
    """Arrays and objects nested N deep, alternating."""
    value: object = 1
    for i in range(n):
        value = {"k": value} if i % 2 else [value]
    return value


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    app = create_app(load(str(tiny_qwen3)), Settings(model_name="tiny", max_tokens_cap=64))
    with running(app) as url:
        yield url, app


def post(url: str, path: str, body) -> tuple[int, str]:
    """(status, error message) of POSTing BODY, the message read in the surface's error shape;
    json.dumps writes a lone surrogate as the escape \\ud800, as a hostile client sends it."""
    r = httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)
    if r.status_code < 400:
        return r.status_code, ""
    error = r.json()["error"]
    return r.status_code, error if isinstance(error, str) else error["message"]


def refused(url: str, path: str, body, needle: str) -> None:
    status, message = post(url, path, body)
    assert status == 400 and needle in message, (status, message)




# -- tool_choice that names no function ---------------------------------------------------------

@pytest.mark.parametrize("body,needle", [
    ({**CHAT, "tools": [FN], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice must be"),
    ({**CHAT, "tools": [FN], "tool_choice": {"type": "function", "function": [1]}}, "tool_choice must be"),
    ({**CHAT, "tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"},
     "tools.0.function must be an object with a string name"),
])
def test_a_tool_choice_that_names_no_function_is_a_400(served, body, needle):
    refused(served[0], "/v1/chat/completions", body, needle)


# -- a value of another JSON type: refused, as the real APIs refuse it, not coerced -------------------

@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}, "max_tokens"),  # lax pydantic: 1 token
    ("/v1/chat/completions", {**CHAT, "temperature": "0.7"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "seed": "7"}, "seed"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "2"}, "max_tokens"),
    ("/v1/messages", {**MESSAGES, "max_tokens": True}, "max_tokens"),
    ("/v1/messages", {**MESSAGES, "stream": 1}, "stream"),
    ("/api/chat", {**OLLAMA_CHAT, "stream": "false"}, "stream"),
])
def test_a_value_of_another_json_type_is_a_400_not_coerced(served, path, body, field):
    refused(served[0], path, body, field)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat"])
@pytest.mark.parametrize("content, headers, needle", [
    (b"", {}, "the request body is empty; send a JSON object"),  # was "Field required"
    ('{"messages": "h\u00e9"}'.encode("latin-1"), {}, "the request body is not valid JSON in UTF-8"),
    (b"\x1f\x8b\x08\x00", {"content-encoding": "gzip"}, "content-encoding gzip is not supported here"),
])
def test_a_body_that_is_not_json_text_says_why(served, path, content, headers, needle):
    """FastAPI's "There was an error parsing the body" said neither what nor how to mend it."""
    r = httpx.post(served[0] + path, content=content, headers={"content-type": "application/json", **headers})
    error = r.json()["error"]
    assert r.status_code == 400 and needle in (error if isinstance(error, str) else error["message"]), r.text


def test_an_integer_for_a_number_is_served(served):
    assert post(served[0], "/v1/chat/completions", {**CHAT, "temperature": 0, "top_p": 1})[0] == 200


# -- JSON nested deeper than any surface takes --------------------------------------------------

def _assistant_call(arguments) -> list:
    return MSG + [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]


DEEP = [  # (path, body builder): built in the test, so pytest never prints a 500-deep value
    ("/v1/chat/completions", lambda: {**CHAT, "tools": [{"type": "function",
                                                          "function": {"name": "f", "parameters": deep()}}]}),
    ("/v1/chat/completions", lambda: {**CHAT, "messages": _assistant_call(deep())}),
    ("/v1/messages", lambda: {**MESSAGES, "messages": MSG + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": deep()}]}]}),
    ("/v1/messages", lambda: {**MESSAGES, "tools": [{"name": "f", "input_schema": deep()}]}),
    ("/v1/messages/count_tokens", lambda: {**COUNT, "tools": [{"name": "f", "input_schema": deep()}]}),
    ("/api/chat", lambda: {**OLLAMA_CHAT, "tools": [{"type": "function",
                                                      "function": {"name": "f", "parameters": deep()}}]}),
]


@pytest.mark.parametrize("case", range(len(DEEP)))
def test_json_nested_too_deep_is_a_400(served, case):
    path, body = DEEP[case]
    refused(served[0], path, body(), f"more than {MAX_JSON_DEPTH} deep")


def test_json_text_nested_too_deep_is_a_400_naming_its_field(served):
    url = served[0]
    text = json.dumps({"a": deep()})
    refused(url, "/v1/chat/completions", {**CHAT, "messages": _assistant_call(text)},
            "messages.1.tool_calls.0.function.arguments nests")
    refused(url, "/api/chat", {**OLLAMA_CHAT, "messages": _assistant_call(text)}, "function.arguments nests")
    refused(url, "/v1/chat/completions", {**CHAT, "guided_json": text}, "guided_json nests")


def test_nesting_within_the_limit_and_brackets_in_strings_are_served(served):
    url = served[0]
    schema = {"type": "object", "properties": {"x": deep(MAX_JSON_DEPTH - 10)}, "description": "[[{{" * 500}
    assert post(url, "/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": schema}}]})[0] == 200


# -- lone surrogates: no text, refused naming where they are ------------------------------------

SURROGATES = [
    ("/v1/completions", {**COMPLETION, "prompt": SURROGATE}, "prompt:"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": SURROGATE}, "guided_regex:"),
    ("/v1/chat/completions", {**CHAT, "guided_grammar": f'start: "{SURROGATE}"'}, "guided_grammar:"),
    ("/v1/messages", {**MESSAGES, "messages": MSG + [{"role": "assistant", "content": SURROGATE}]},
     "messages.1.content:"),
    ("/api/generate", {**OLLAMA_GENERATE, "raw": True, "prompt": SURROGATE}, "prompt:"),
    # what an error message would echo back
    ("/v1/chat/completions", {**CHAT, "model": SURROGATE}, "model:"),
    ("/v1/messages", {**MESSAGES, "model": SURROGATE}, "model:"),
    ("/api/chat", {**OLLAMA_CHAT, "model": SURROGATE}, "model:"),
    ("/v1/chat/completions", {**CHAT, SURROGATE: 1}, "a\\ud800b:"),
    ("/api/chat", {**OLLAMA_CHAT, "options": {SURROGATE: 1}}, "options.a\\ud800b:"),
    ("/v1/chat/completions", {**CHAT, "tools": [FN], "tool_choice": {"type": "function",
                                                                     "function": {"name": SURROGATE}}},
     "tool_choice.function.name:"),
    ("/v1/chat/completions", {**CHAT, "messages": _assistant_call(json.dumps({"a": SURROGATE}))},
     "messages.1.tool_calls.0.function.arguments.a:"),
]


@pytest.mark.parametrize("path,body,where", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_its_field(served, path, body, where):
    refused(served[0], path, body, f"{where} holds a lone UTF-16 surrogate")


def test_paired_surrogates_are_text(served):
    status, _ = post(served[0], "/v1/completions", {**COMPLETION, "prompt": "a \U0001F600 b"})
    assert status == 200


# -- an unexpected error: a shaped 500, and the connection serves on ----------------------------

def test_a_500_keeps_the_connection_for_the_next_request(served, monkeypatch):
    url, app = served
    port = int(url.rsplit(":", 1)[1])
    server = app.state.server
    real = server.check_model
    broken = {"yes": True}

    def check_model(name):
        if broken["yes"]:
            raise RuntimeError("a bug")
        return real(name)

    monkeypatch.setattr(server, "check_model", check_model)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps(COMPLETION)
    connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    first = connection.getresponse()
    assert first.status == 500
    assert json.loads(first.read())["error"]["message"] == "internal server error"
    broken["yes"] = False
    time.sleep(0.2)  # the server would have closed the connection by now
    connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    second = connection.getresponse()
    assert second.status == 200, second.read()
    connection.close()


# -- stop strings: bounded in count and length, matched on the new text only ---------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/messages", {**MESSAGES, "stop_sequences": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop_sequences"),
    ("/v1/messages", {**MESSAGES, "stop_sequences": ["x" * (MAX_STOP_LENGTH + 1)]}, "stop_sequences.0"),
    ("/api/chat", {**OLLAMA_CHAT, "options": {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}}, "options.stop"),
    ("/api/generate", {**OLLAMA_GENERATE, "options": {"stop": "x" * (MAX_STOP_LENGTH + 1)}}, "options.stop.0"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 5}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": ["y", "x" * (MAX_STOP_LENGTH + 1)]}, "stop.1"),
])
def test_stop_strings_are_bounded(served, path, body, param):
    refused(served[0], path, body, param)


def test_stop_strings_at_the_bounds_are_served(served):
    stops = ["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS
    assert post(served[0], "/v1/messages", {**MESSAGES, "stop_sequences": stops})[0] == 200
    assert post(served[0], "/api/chat", {**OLLAMA_CHAT, "options": {"num_predict": 2, "stop": stops}})[0] == 200


def _held_back_by_every_prefix(text: str, stops: list[str]) -> int:
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = max(keep, n)
                break
    return keep


def test_held_back_text_is_the_longest_stop_prefix_at_the_end():
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 8)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 3))]
        assert held_back(text, stops) == _held_back_by_every_prefix(text, stops), (text, stops)


# -- /api/show ----------------------------------------------------------------------------------

def test_api_show_names_the_model_not_its_path(served, tiny_qwen3):
    r = httpx.post(served[0] + "/api/show", json={"model": "tiny"}, timeout=60)
    assert r.status_code == 200
    assert str(tiny_qwen3) not in r.text and "FROM tiny" in r.json()["modelfile"]


# -- sampling values float32 cannot carry ---------------------------------------------------------

@pytest.mark.parametrize("path,body,needle", [
    ("/api/chat", {**OLLAMA_CHAT, "options": {"temperature": 1e308}}, "options.temperature must be between 0 and"),
    ("/api/chat", {**OLLAMA_CHAT, "options": {"temperature": float("inf")}}, "options.temperature must be a finite"),
    ("/api/generate", {**OLLAMA_GENERATE, "options": {"top_p": 1.5}}, "options.top_p must be between 0 and 1"),
    ("/v1/chat/completions", {**CHAT, "temperature": 1, "top_p": -1e-300}, "top_p must be between 0 and 1"),
    ("/v1/messages", {**MESSAGES, "top_p": float("-inf")}, "top_p"),
])
def test_sampling_values_beyond_float32_are_a_400(served, path, body, needle):
    refused(served[0], path, body, needle)


def test_sampling_values_at_the_bounds_are_served(served):
    options = {"num_predict": 2, "temperature": MAX_TEMPERATURE, "top_p": MIN_TOP_P}
    assert post(served[0], "/api/generate", {**OLLAMA_GENERATE, "options": options})[0] == 200


@pytest.mark.parametrize("top_p", [0.0, 1e-300, MIN_TOP_P / 2])
def test_a_vanishing_top_p_is_greedy(served, top_p):
    """As a vanishing temperature is: the answer is temperature 0's, token for token, at any
    temperature and seed (float32 turned 1e-300 into 0 and sampling into one token repeated)."""
    def answer(options):
        body = {**OLLAMA_GENERATE, "options": {"num_predict": 8, **options}}
        r = httpx.post(served[0] + "/api/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["response"]

    greedy = answer({"temperature": 0})
    assert answer({"temperature": 1.5, "top_p": top_p, "seed": 3}) == greedy
    assert answer({"temperature": 1.5, "top_p": top_p, "seed": 4}) == greedy


def test_the_openai_error_names_the_field_as_param(served):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": SURROGATE}]})
    r = httpx.post(served[0] + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
