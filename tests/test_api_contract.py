"""The server's API contract on its three surfaces (OpenAI, Anthropic, Ollama): a field a body
may not carry is a 400 naming it, in the surface's error shape; the real APIs' no-op fields
change nothing; penalties and logit_bias reach the engine (and change the text); every
surface's limits come from mlxspec.options; count_tokens counts what /v1/messages prefills;
endpoints this server lacks answer in the surface's shape. A real uvicorn server over the tiny
model, whose chat template here renders tools and the thinking switch."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from mlxspec import options
from mlxspec.api import Chunk, load
from mlxspec.engine.stats import Stats
from mlxspec.options import DEFAULT_PENALTY_WINDOW, OLLAMA_REPEAT_LAST_N, ConstraintSpec
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running

# renders tools (as a system turn) and, with enable_thinking false, an empty think block: a
# count that skipped either would differ from what /v1/messages prefills
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MSG = [{"role": "user", "content": "def add(a, b): return a + b\ndef add(a, b):"}]
CHAT = {"messages": MSG, "max_tokens": 2, "temperature": 0}
COMPLETION = {"prompt": "x", "max_tokens": 2, "temperature": 0}
MESSAGES = {"model": "tiny", "messages": MSG, "max_tokens": 2, "temperature": 0}
COUNT = {"model": "tiny", "messages": MSG}
OLLAMA_CHAT = {"model": "tiny", "messages": MSG, "stream": False, "options": {"num_predict": 2, "temperature": 0}}
OLLAMA_GENERATE = {"model": "tiny", "prompt": "x", "stream": False, "options": {"num_predict": 2}}
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.fixture(scope="module")
def spec(tiny_qwen3, tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract") / "model"
    shutil.copytree(tiny_qwen3, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return load(str(folder))


@pytest.fixture(scope="module")
def served(spec):
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=64))
    with running(app) as url:
        yield url, app


class Recorder:
    """Stands in for the model behind the worker: keeps what SpecModel.stream was handed and
    answers TEXT at once."""

    def __init__(self, text: str = "ok"):
        self.text, self.calls = text, []

    def stream(self, prompt, request):
        self.calls.append((list(prompt), request))
        yield Chunk(text=self.text, tokens=[1], stats=Stats())

    @property
    def request(self):
        return self.calls[-1][1]


@pytest.fixture
def recorder(served, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(served[1].state.server.worker, "spec", rec)
    return rec


def post(url: str, path: str, body) -> httpx.Response:
    """POST BODY as JSON; a float NaN or infinity goes as Python's JSON writes it (NaN, Infinity)."""
    return httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)


def error_message(path: str, r: httpx.Response) -> tuple[str, str | None]:
    """(message, param) of an error answer, checking it has its surface's shape."""
    body = r.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"], None
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"], None
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"], body["error"]["param"]


# -- fields a body may not carry -----------------------------------------------------------------

REFUSED = [
    ("/v1/chat/completions", {**CHAT, "max_tokns": 5}, "max_tokns", "did you mean max_tokens?"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, "n", "n must be 1"),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy"}}, "audio", None),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", None),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usge": True}}, "stream_options.include_usge",
     "did you mean include_usage?"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object", "strict": True}},
     "response_format.strict", None),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities.1", None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 1}}, "logit_bias", "vocabulary"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 2.5}, "frequency_penalty", "between -2 and 2"),
    ("/v1/chat/completions", {**CHAT, "repetition_context_size": 0}, "repetition_context_size", "between 1 and"),
    ("/v1/chat/completions", {**CHAT, "repetition_context_size": 10**30}, "repetition_context_size", "between 1 and"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature", "between 0 and 2"),
    ("/v1/chat/completions", {**CHAT, "temperature": float("inf")}, "temperature", "finite"),  # JSON's Infinity
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix", "no fill-in-the-middle tokens"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of", None),
    ("/v1/completions", {**COMPLETION, "presence_penalty": -3}, "presence_penalty", "between -2 and 2"),
    ("/v1/messages", {**MESSAGES, "frequency_penalty": 0.5}, "frequency_penalty", None),
    ("/v1/messages", {**MESSAGES, "top_kk": 5}, "top_kk", "did you mean top_k?"),
    ("/v1/messages", {**MESSAGES, "temperature": 1.5}, "temperature", "between 0 and 1"),
    ("/v1/messages", {**MESSAGES, "tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ("/v1/messages", {**MESSAGES, "tool_choice": {"type": "auto", "force": True}}, "tool_choice.force", None),
    ("/v1/messages/count_tokens", {**COUNT, "max_tokns": 5}, "max_tokns", None),
    ("/api/chat", {**OLLAMA_CHAT, "keepalive": "5m"}, "keepalive", "did you mean keep_alive?"),
    ("/api/chat", {**OLLAMA_CHAT, "options": {"temprature": 0.1}}, "options.temprature", "did you mean temperature?"),
    ("/api/chat", {**OLLAMA_CHAT, "options": {"mirostat": 2}}, "options.mirostat", "not supported"),
    ("/api/chat", {**OLLAMA_CHAT, "options": {"repeat_penalty": 0}}, "options.repeat_penalty", "more than 0"),
    ("/api/chat", {**OLLAMA_CHAT, "options": {"temperature": float("nan")}}, "options.temperature", "finite"),
    ("/api/generate", {**OLLAMA_GENERATE, "options": {"num_predit": 3}}, "options.num_predit",
     "did you mean num_predict?"),
    ("/api/generate", {**OLLAMA_GENERATE, "options": {"typical_p": 0.5}}, "options.typical_p", "not supported"),
    ("/api/generate", {**OLLAMA_GENERATE, "options": {"repeat_last_n": -2}}, "options.repeat_last_n", None),
]


@pytest.mark.parametrize("path, body, field, says", REFUSED, ids=[f"{p}:{f}" for p, _, f, _ in REFUSED])
def test_a_field_the_surface_does_not_take_is_a_400_naming_it(served, recorder, path, body, field, says):
    r = post(served[0], path, body)
    assert r.status_code == 400, r.text
    message, param = error_message(path, r)
    assert message.startswith(field) or f" {field} " in f" {message} ", message
    assert "\n" not in message and "Traceback" not in r.text
    if param is not None:
        assert param == field
    if says:
        assert says in message
    assert not recorder.calls  # nothing was generated


ACCEPTED = [
    ("/v1/chat/completions", CHAT, {"user": "u1", "safety_identifier": "s", "store": False, "metadata": {"a": "b"},
                                    "service_tier": "auto", "prompt_cache_key": "k", "n": 1, "modalities": ["text"],
                                    "parallel_tool_calls": True, "stream_options": {"include_obfuscation": False}}),
    ("/v1/completions", COMPLETION, {"user": "u1", "best_of": 1, "n": 1}),
    ("/v1/messages", MESSAGES, {"metadata": {"user_id": "u"}, "service_tier": "auto"}),
    ("/api/chat", OLLAMA_CHAT, {"keep_alive": "5m", "options": {
        **OLLAMA_CHAT["options"], "num_ctx": 4096, "num_gpu": 99, "num_thread": 8, "use_mmap": True,
        "penalize_newline": True, "mirostat": 0, "mirostat_tau": 5.0, "typical_p": 1.0, "tfs_z": 1.0}}),
]


@pytest.mark.parametrize("path, body, extra", ACCEPTED, ids=[p for p, _, _ in ACCEPTED])
def test_the_real_apis_no_op_fields_are_accepted_and_change_nothing(served, recorder, path, body, extra):
    url, _ = served
    assert post(url, path, body).status_code == 200
    r = post(url, path, {**body, **extra})
    assert r.status_code == 200, r.text
    assert recorder.calls[0] == recorder.calls[1]  # the same prompt, the same GenerationRequest


# -- penalties and logit_bias --------------------------------------------------------------------

OPENAI_PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.3,
                    "repetition_context_size": 7, "logit_bias": {"5": 10, "7": -100}}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_openai_penalties_and_logit_bias_reach_the_generation_request(served, recorder, path, body):
    url, _ = served
    assert post(url, path, body).status_code == 200
    g = recorder.request
    assert (g.repetition_penalty, g.presence_penalty, g.frequency_penalty, g.penalty_window, g.logit_bias) == \
        (None, 0.0, 0.0, DEFAULT_PENALTY_WINDOW, None)
    assert post(url, path, {**body, **OPENAI_PENALTIES}).status_code == 200
    g = recorder.request
    assert (g.repetition_penalty, g.presence_penalty, g.frequency_penalty, g.penalty_window, g.logit_bias) == \
        (1.3, -0.25, 0.5, 7, {5: 10.0, 7: -100.0})


@pytest.mark.parametrize("given, expected", [
    ({}, (None, 0.0, 0.0, OLLAMA_REPEAT_LAST_N)),
    ({"repeat_penalty": 1.2, "presence_penalty": 0.1, "frequency_penalty": 0.2, "repeat_last_n": 16},
     (1.2, 0.1, 0.2, 16)),
    ({"repeat_penalty": 1.2, "repeat_last_n": 0}, (None, 0.0, 0.0, DEFAULT_PENALTY_WINDOW)),  # Ollama's "off"
    ({"repeat_penalty": 1.2, "repeat_last_n": -1}, (1.2, 0.0, 0.0, "context")),  # Ollama's "the whole context"
])
@pytest.mark.parametrize("path, body", [("/api/chat", OLLAMA_CHAT), ("/api/generate", OLLAMA_GENERATE)])
def test_ollama_penalty_options_reach_the_generation_request(served, recorder, spec, path, body, given, expected):
    r = post(served[0], path, {**body, "options": {**body["options"], **given}})
    assert r.status_code == 200, r.text
    g = recorder.request
    if expected[3] == "context":
        expected = (*expected[:3], spec.target.context_length)
    assert (g.repetition_penalty, g.presence_penalty, g.frequency_penalty, g.penalty_window) == expected
    assert g.logit_bias is None


def test_anthropic_has_no_penalties(served, recorder):
    assert post(served[0], "/v1/messages", MESSAGES).status_code == 200
    g = recorder.request
    assert (g.repetition_penalty, g.presence_penalty, g.frequency_penalty, g.logit_bias) == (None, 0.0, 0.0, None)


def test_a_large_logit_bias_takes_over_the_openai_answer(served, spec):
    url, _ = served
    x = spec.tokenizer.encode("x")[-1]
    body = {"messages": MSG, "max_tokens": 4, "temperature": 0}
    plain = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    biased = post(url, "/v1/chat/completions", {**body, "logit_bias": {str(x): 100}}).json()
    assert biased["choices"][0]["message"]["content"] == spec.tokenizer.decode([x] * 4) != plain
    text = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0,
                                         "logit_bias": {str(x): 100}}).json()["choices"][0]["text"]
    assert text == spec.tokenizer.decode([x] * 4)


def test_penalties_change_the_answer_on_openai_and_ollama(served, spec):
    """Greedy text that repeats a token is different with that token penalized."""
    url, _ = served
    chat = {"messages": MSG, "max_tokens": 16, "temperature": 0}
    plain = post(url, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    ids = list(spec.tokenizer.encode(plain))
    assert len(set(ids)) < len(ids)  # the premise: the plain answer repeats itself
    penalized = post(url, "/v1/chat/completions", {**chat, "presence_penalty": 2, "frequency_penalty": 2})
    assert penalized.json()["choices"][0]["message"]["content"] != plain
    ollama = {"model": "tiny", "messages": MSG, "stream": False, "options": {"num_predict": 16, "temperature": 0}}
    assert post(url, "/api/chat", ollama).json()["message"]["content"] == plain  # the same text unpenalized
    ollama["options"] |= {"repeat_penalty": 5.0, "presence_penalty": 2}
    assert post(url, "/api/chat", ollama).json()["message"]["content"] != plain


# -- one source for limits -----------------------------------------------------------------------

@pytest.mark.parametrize("path, body, where", [
    ("/v1/chat/completions", CHAT, lambda b, t: {**b, "temperature": t}),
    ("/v1/completions", COMPLETION, lambda b, t: {**b, "temperature": t}),
    ("/v1/messages", MESSAGES, lambda b, t: {**b, "temperature": t}),
    ("/api/chat", OLLAMA_CHAT, lambda b, t: {**b, "options": {**b["options"], "temperature": t}}),
    ("/api/generate", OLLAMA_GENERATE, lambda b, t: {**b, "options": {**b["options"], "temperature": t}}),
])
def test_every_surface_bounds_temperature_from_options(served, recorder, monkeypatch, path, body, where):
    """Each surface reads its bounds from options.SURFACE_LIMITS (else LIMITS): changing the
    table changes what every surface answers."""
    surface = "ollama" if path.startswith("/api/") else "anthropic" if path.startswith("/v1/messages") else "openai"
    url, _ = served
    assert post(url, path, where(body, 0.7)).status_code == 200
    monkeypatch.setitem(options.SURFACE_LIMITS[surface], "temperature", (lambda v: v <= 0.5, "at most 0.5"))
    r = post(url, path, where(body, 0.7))
    assert r.status_code == 400 and "temperature must be at most 0.5" in error_message(path, r)[0]


def test_the_bounds_that_differ_on_purpose():
    assert options.limit_of("temperature", "openai")[0](2.0) and not options.limit_of("temperature", "openai")[0](2.1)
    assert not options.limit_of("temperature", "anthropic")[0](1.1)
    assert options.limit_of("temperature", "ollama") is options.LIMITS["temperature"]
    assert options.limit_of("top_p", "anthropic") is options.LIMITS["top_p"]


# -- count_tokens counts what /v1/messages prefills ----------------------------------------------

TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                            "input": {"city": "Paris"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}]


@pytest.mark.parametrize("shape", [
    {"messages": MSG},
    {"system": "Be brief.", "messages": MSG},
    {"system": [{"type": "text", "text": "Be brief."}], "messages": MSG, "tools": [WEATHER]},
    {"messages": TURNS, "tools": [WEATHER]},
    {"messages": MSG + [{"role": "assistant", "content": "Sure, "}]},  # a prefill
    {"messages": MSG, "thinking": {"type": "disabled"}},
    {"messages": MSG, "tools": [WEATHER], "tool_choice": {"type": "any"}},  # forced: reasoning off
    {"messages": MSG, "tools": [WEATHER], "tool_choice": {"type": "none"}},
], ids=["user", "system", "system-blocks-tools", "multi-turn-tools", "prefill", "thinking-off", "tool-any",
        "tool-none"])
def test_count_tokens_is_what_messages_prefills(served, recorder, shape):
    url, _ = served
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, **shape}  # the same body: count what you send
    counted, created = post(url, "/v1/messages/count_tokens", body), post(url, "/v1/messages", body)
    assert counted.status_code == created.status_code == 200, (counted.text, created.text)
    assert counted.json()["input_tokens"] == created.json()["usage"]["input_tokens"] == len(recorder.calls[-1][0])


# -- tool_choice and parallel tool calls ---------------------------------------------------------

def test_anthropic_tool_choice_forces_a_call_and_disable_parallel_keeps_one(served, monkeypatch):
    url, app = served
    rec = Recorder(TWO_CALLS)
    monkeypatch.setattr(app.state.server.worker, "spec", rec)
    body = {**MESSAGES, "tools": [WEATHER]}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        assert post(url, "/v1/messages", {**body, "tool_choice": choice}).status_code == 200
        assert rec.request.constraint.kind == "grammar" and "get_weather" in rec.request.constraint.value
    assert post(url, "/v1/messages", {**body, "tool_choice": {"type": "auto"}}).json()["stop_reason"] == "tool_use"
    assert rec.request.constraint is None
    one = {**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    calls = [b["input"] for b in post(url, "/v1/messages", one).json()["content"] if b["type"] == "tool_use"]
    assert calls == [{"city": "Paris"}]
    streamed = post(url, "/v1/messages", {**one, "stream": True}).text
    assert "Paris" in streamed and "Rome" not in streamed
    r = post(url, "/v1/messages", {**body, "tool_choice": {"type": "tool", "name": "nope"}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_openai_parallel_tool_calls_false_keeps_the_first_call(served, monkeypatch):
    url, app = served
    monkeypatch.setattr(app.state.server.worker, "spec", Recorder(TWO_CALLS))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]
    body = {**CHAT, "tools": tools}
    assert len(post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["tool_calls"]) == 2
    one = post(url, "/v1/chat/completions", {**body, "parallel_tool_calls": False}).json()
    assert [json.loads(c["function"]["arguments"]) for c in one["choices"][0]["message"]["tool_calls"]] == \
        [{"city": "Paris"}]
    streamed = post(url, "/v1/chat/completions", {**body, "parallel_tool_calls": False, "stream": True}).text
    assert "Paris" in streamed and "Rome" not in streamed


# -- constrained output in the request models --------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_guided_json_is_a_json_schema_constraint(served, recorder):
    url, _ = served
    for given in (SCHEMA, json.dumps(SCHEMA)):
        assert post(url, "/v1/chat/completions", {**CHAT, "guided_json": given}).status_code == 200
        assert recorder.request.constraint == ConstraintSpec("json_schema", SCHEMA)
    r = post(url, "/v1/chat/completions", {**CHAT, "guided_json": "{not json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"


def test_openapi_shows_every_field_a_request_takes(served):
    schemas = httpx.get(served[0] + "/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatRequest"]["properties"]
    for field in ("response_format", "guided_json", "guided_regex", "guided_grammar", "logit_bias",
                  "frequency_penalty", "presence_penalty", "repetition_penalty", "repetition_context_size",
                  "parallel_tool_calls", "stream_options"):
        assert field in chat, field
    assert "between 0 and 2" in chat["temperature"]["description"]
    assert "between 0 and 1" in schemas["MessagesBody"]["properties"]["temperature"]["description"]
    assert schemas["ChatRequest"].get("additionalProperties") is False


# -- endpoints this server lacks -----------------------------------------------------------------

@pytest.mark.parametrize("method, path, status", [
    ("POST", "/api/pull", 501), ("POST", "/api/embed", 501), ("POST", "/api/embeddings", 501),
    ("DELETE", "/api/delete", 501), ("POST", "/api/blobs/sha256:abc", 501), ("GET", "/api/nothing", 404),
    ("POST", "/v1/embeddings", 501), ("GET", "/v1/nothing", 404),
    ("POST", "/v1/messages/batches", 404),
])
def test_a_missing_endpoint_answers_in_its_surfaces_shape(served, method, path, status):
    r = httpx.request(method, served[0] + path, json={"model": "tiny"}, timeout=30)
    assert r.status_code == status, r.text
    message, _ = error_message(path, r)
    assert path in message and ("not supported" if status == 501 else "no endpoint") in message
