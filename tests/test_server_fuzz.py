"""A seeded fuzzer over every POST route of ``mlxspec serve`` (issue 33): valid bodies of each
route mutated (tests/fuzz_bodies.py: wrong types, non-finite and huge numbers, missing and
unknown fields, nesting 100 to 600 deep in tools, tool-call arguments and their JSON text,
tool_use input, input_schema and response schemas, lone surrogates in every string and key,
broken bytes), sent over one kept-alive connection (a few chunked) to a real uvicorn server
over the demo model, answers at most 4 tokens long.

Every answer is below 500; a 4xx is a JSON error in its surface's shape (OpenAI
``{"error": {...}}``, Anthropic ``{"type": "error", "error": {...}}``, Ollama ``{"error": "..."}``)
with a one-line message; a 2xx is the route's JSON (or its SSE / NDJSON stream, with no error
in it the client did not cause); and the connection serves on, which a valid request on it
checks after a sample of the answers.

MLXSPEC_FUZZ_SEED picks another seed, MLXSPEC_FUZZ_SCALE (e.g. 10) sends that many times the
requests; a failure names the seed and case, which ``fuzz_bodies.body_for(seed, path, n)``
builds again.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import time
from collections import Counter

import pytest

import fuzz_bodies
from fuzz_bodies import MODEL, ROUTES, SURROGATE, VALID, body_for, dumps
from mlxspec.api import load
from mlxspec.models.demo import demo_model_path
from mlxspec.options import MAX_JSON_DEPTH
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings, surface_of
from mlxspec.server.json_limits import too_deep
from server_helpers import running

DEFAULT_SEED = 33
SEED = int(os.environ.get("MLXSPEC_FUZZ_SEED", DEFAULT_SEED))
SCALE = float(os.environ.get("MLXSPEC_FUZZ_SCALE", "1"))
# requests per route: 1,500 in all (20-40 s here), most on the routes with the most to reach
CASES = {"/v1/chat/completions": 340, "/v1/completions": 140, "/v1/messages": 260,
         "/v1/messages/count_tokens": 140, "/api/chat": 240, "/api/generate": 140, "/api/show": 40,
         "/v1/responses": 200}
# share of a route's cases that must be served (2xx): the mutations must reach past the first check
SERVED_AT_LEAST = 0.1
MAX_TOKENS_CAP = 4

# the demo model's template renders neither tools nor past tool calls; this one does (as JSON,
# as real templates do), and the thinking switch, so mutations reach jinja and tojson
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "demo"
    shutil.copytree(demo_model_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    app = create_app(load(str(folder)), Settings(model_name=MODEL, max_tokens_cap=MAX_TOKENS_CAP))
    with running(app) as url:
        yield int(url.rsplit(":", 1)[1])


class Connection:
    """One kept-alive HTTP/1.1 connection; a request on it never opens another silently."""

    def __init__(self, port: int):
        self.port = port
        self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.http.connect()

    def post(self, path: str, content: bytes, content_type: str | None,
             chunked: bool = False) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, whether the server ends the connection); CHUNKED: the
        body sent in two chunks (Transfer-Encoding: chunked, no Content-Length)."""
        socket = self.http.sock
        headers = {"content-type": content_type} if content_type else {}
        if chunked:
            half = len(content) // 2
            self.http.request("POST", path, body=iter([content[:half], content[half:]]), headers=headers,
                              encode_chunked=True)
        else:
            self.http.request("POST", path, body=content, headers=headers)
        response = self.http.getresponse()
        data = response.read()
        if self.http.sock is not socket and not response.will_close:
            raise AssertionError("the connection was opened again")
        return response.status, response.getheader("content-type") or "", data, response.will_close

    def reopen(self) -> None:
        self.http.close()
        self.__init__(self.port)


def error_message(surface: str, body) -> str:
    """The message of a 4xx body in SURFACE's error shape; AssertionError saying how it is not."""
    if surface == "ollama":
        assert isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    if surface == "anthropic":
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
        error = body["error"]
        assert isinstance(error, dict) and set(error) == {"type", "message"}, body
        assert isinstance(error["type"], str) and isinstance(error["message"], str), body
        return error["message"]
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), body
    assert isinstance(error["message"], str) and isinstance(error["type"], str), body
    assert error["param"] is None or isinstance(error["param"], str), body
    return error["message"]


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(text: bytes | str):
    """TEXT parsed as standard JSON (Python's json also reads NaN and Infinity, clients do not)."""
    return json.loads(text, parse_constant=_no_constant)


def stream_items(content_type: str, data: bytes) -> list:
    """The JSON objects of an SSE or NDJSON answer."""
    text = data.decode("utf-8")
    if content_type.startswith("application/x-ndjson"):
        return [strict_json(line) for line in text.splitlines() if line.strip()]
    items = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            items.append(strict_json(line[6:]))
    return items


def fault(path: str, status: int, content_type: str, data: bytes) -> str | None:
    """What is wrong with an answer; None: nothing."""
    if status >= 500:
        return f"{status}: {data[:300]!r}"
    try:
        if status >= 400:
            message = error_message(surface_of(path), strict_json(data))
            assert message and "\n" not in message and "Traceback" not in message, f"not one line: {message!r}"
            return None
        if content_type.startswith(("text/event-stream", "application/x-ndjson")):
            for item in stream_items(content_type, data):
                error = item.get("error") if isinstance(item, dict) else None
                if error is not None:  # an error after the answer began: only a client's may be there
                    kind = error.get("type") if isinstance(error, dict) else None
                    assert kind not in ("api_error", "server_error"), f"an internal error in the stream: {item}"
            return None
        assert isinstance(strict_json(data), dict), "not a JSON object"
    except (AssertionError, ValueError) as err:
        return f"{status} {content_type}: {' '.join(str(err).split())[:300]} in {data[:300]!r}"
    return None


def fuzz(port: int, path: str, n: int) -> tuple[Counter, list[str]]:
    """Send N cases of PATH; (statuses, failures)."""
    connection, statuses, failures = Connection(port), Counter(), []
    valid = dumps(VALID[path]).encode()
    for number in range(n):
        case = body_for(SEED, path, number)
        try:
            status, content_type, data, closes = connection.post(case.path, case.content, case.content_type,
                                                                 chunked=number % 16 == 5)
            statuses[status] += 1
            problem = fault(path, status, content_type, data)
            if problem is None and closes:
                problem = f"{status}, and the server closes the connection"
            if problem is None and (number % 4 == 0 or status >= 400 and number % 2):
                status, _, data, _ = connection.post(path, valid, "application/json")
                if status != 200:
                    problem = f"then a valid request on the same connection: {status} {data[:200]!r}"
        except (AssertionError, OSError, http.client.HTTPException) as err:
            problem = f"the connection failed: {type(err).__name__}: {err}"
            connection.reopen()
        if problem is not None:
            failures.append(f"{problem}\n    {case.describe()}")
    return statuses, failures


@pytest.mark.parametrize("path", list(CASES))
def test_fuzzed_bodies_get_no_5xx_and_shaped_errors_and_the_connection_serves_on(served, path):
    n = max(1, int(CASES[path] * SCALE))
    began = time.perf_counter()
    statuses, failures = fuzz(served, path, n)
    took = time.perf_counter() - began
    summary = f"{path}: {n} requests in {took:.1f} s, statuses {dict(sorted(statuses.items()))}, seed {SEED}"
    print(summary)
    assert not failures, (f"{len(failures)} of {n} failed ({summary}); build a case again with "
                          f"fuzz_bodies.body_for({SEED}, {path!r}, N):\n" + "\n".join(failures[:12]))
    served_share = sum(v for k, v in statuses.items() if k < 300) / n
    assert served_share >= SERVED_AT_LEAST, f"only {served_share:.0%} served: the mutations stop at the first check"


# -- the fuzzer itself: it generates what broke the server before ---------------------------------

def _strings_and_keys(value, path=()):
    """(path, text) of every string and (path + ("<key>",), key) of every key, iteratively."""
    pending = [(path, value)]
    while pending:
        where, v = pending.pop()
        if isinstance(v, str):
            yield where, v
        elif isinstance(v, dict):
            for k, item in v.items():
                yield (*where, "<key>"), k
                pending.append(((*where, k), item))
        elif isinstance(v, list):
            pending.extend(((*where, str(i)), item) for i, item in enumerate(v))


def test_the_fuzzer_generates_deep_nesting_surrogates_odd_numbers_and_missing_fields():
    surrogates, deep_places, literals, missing, unknown = set(), set(), set(), set(), 0
    bases = json.dumps(ROUTES)
    required = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/messages": "max_tokens",
                "/v1/messages/count_tokens": "messages", "/api/chat": "model", "/api/generate": "model"}
    for path, n in CASES.items():
        for number in range(n):
            case = body_for(DEFAULT_SEED, path, number)
            for label in case.mutations:
                if label.startswith("deep ") and int(label.split()[1]) > MAX_JSON_DEPTH:
                    deep_places.add((path, label.split(" at ")[1]))
                unknown += label.startswith("add ")
            literals |= {x for x in ("1e309", "Infinity", "NaN", "1" * 4400) if x.encode() in case.content}
            literals |= {"-0"} if re.search(rb"-0(\.0)?[,}\]]", case.content) else set()
            try:
                body = json.loads(case.content)
            except ValueError:
                continue
            if isinstance(body, dict) and required.get(path) not in body:
                missing.add(path)
            for where, text in _strings_and_keys(body):
                # a surrogate, or its escape in JSON text (arguments), named by its field (stop.0: stop)
                if any("\ud800" <= c <= "\udfff" for c in text) or re.search(r"\\u[dD][89a-fA-F]", text):
                    surrogates.add((path, next((w for w in reversed(where) if not w.isdigit()), "")))
    assert too_deep(dumps({"a": fuzz_bodies.deep(600)}).encode(), 500)
    assert {("/v1/chat/completions", "tools"), ("/v1/chat/completions", "arguments"),
            ("/v1/chat/completions", "arguments text"), ("/v1/chat/completions", "response_format"),
            ("/v1/chat/completions", "guided_json text"), ("/api/chat", "tools"), ("/api/chat", "arguments text"),
            ("/api/chat", "format"), ("/v1/messages", "input_schema"), ("/v1/messages", "tool_use.input"),
            ("/v1/messages/count_tokens", "input_schema"), ("/v1/messages/count_tokens", "tool_use.input"),
            } <= deep_places
    assert literals == {"1e309", "Infinity", "NaN", "-0", "1" * 4400}
    assert set(required) <= missing, set(required) - missing
    assert unknown > 50
    wanted = {("/v1/completions", "prompt"), ("/v1/chat/completions", "guided_regex"),
              ("/v1/chat/completions", "guided_grammar"), ("/v1/chat/completions", "model"),
              ("/v1/messages", "model"), ("/api/chat", "model"), ("/api/generate", "prompt"),
              ("/v1/chat/completions", "<key>"), ("/v1/messages", "<key>"), ("/api/chat", "<key>"),
              ("/v1/chat/completions", "name"), ("/v1/messages", "name"), ("/v1/messages", "content"),
              ("/v1/chat/completions", "arguments"), ("/v1/messages", "stop_sequences"),
              ("/v1/chat/completions", "stop")}
    assert wanted <= surrogates, wanted - surrogates
    assert json.dumps(ROUTES) == bases, "a mutation changed a base body: cases would depend on their order"
    assert SURROGATE.encode("utf-8", "surrogatepass") not in b"".join(
        body_for(DEFAULT_SEED, p, i).content for p in ROUTES for i in range(20))  # sent as the \\ud800 escape


# -- what the fuzzer found, each named ------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
LONG = "1" * 5000  # an integer JSON reads, which Python refuses to convert past 4,300 digits
HUGE = "1" + "0" * 400  # an integer past any float


def _post(port: int, path: str, content: str) -> tuple[int, object, bytes]:
    """(status, the JSON body, or None for a stream, the raw body); the answer is as fault() wants."""
    status, content_type, data, _ = Connection(port).post(path, content.encode(), "application/json")
    assert fault(path, status, content_type, data) is None, fault(path, status, content_type, data)
    return status, strict_json(data) if content_type.startswith("application/json") else None, data


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "response_format": {"type": "json_object"},
                              "logprobs": True, "top_logprobs": 5}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "guided_regex": "[a-z]+", "logprobs": True,
                              "top_logprobs": 5, "stream": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "[a-z]+", "logprobs": 5}),
    ("/api/chat", {"model": MODEL, "messages": USER, "format": "json", "logprobs": True, "top_logprobs": 5,
                   "stream": False, "options": {"num_predict": 4}}),
    ("/api/generate", {"model": MODEL, "prompt": "x", "format": "json", "logprobs": True, "top_logprobs": 5,
                       "options": {"num_predict": 4}}),
])
def test_logprobs_of_tokens_a_constraint_rules_out_are_json(served, path, body):
    """A constraint masks tokens to -inf; among the top alternatives they were -Infinity (not
    JSON) in streams and a 500 otherwise. They are OpenAI's -9999.0."""
    status, _, data = _post(served, path, json.dumps(body))
    assert status == 200 and b"logprob" in data and b"Infinity" not in data


@pytest.mark.parametrize("path,raw,status", [
    ("/api/chat", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": false, '
                  '"options": {"num_predict": 2, "repeat_last_n": %s}}' % HUGE, 400),
    ("/api/generate", '{"model": "tiny", "prompt": "x", "stream": false, "options": {"temperature": %s}}' % HUGE, 400),
    ("/api/generate", '{"model": "tiny", "prompt": "x", "stream": false, '
                      '"options": {"num_predict": 2, "top_k": %s, "seed": -%s}}' % (HUGE, HUGE), 200),
])
def test_an_integer_past_any_float_in_ollama_options_is_not_a_500(served, path, raw, status):
    assert _post(served, path, raw)[0] == status


def _call(arguments: str) -> list:
    return USER + [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", {"messages": _call('{"a": %s}' % LONG), "max_tokens": 2},
     "messages.1.tool_calls.0.function.arguments is not valid JSON"),
    ("/api/chat", {"model": MODEL, "messages": _call('{"a": %s}' % LONG), "stream": False},
     "messages.1.tool_calls.0.function.arguments is not valid JSON"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "guided_json": '{"maxLength": %s}' % LONG},
     "guided_json must be a JSON schema"),
])
def test_json_text_with_an_integer_python_refuses_is_a_400(served, path, body, needle):
    status, answer, _ = _post(served, path, json.dumps(body))
    assert status == 400 and needle in error_message(surface_of(path), answer)


def test_a_generated_tool_call_no_json_response_can_carry_is_text():
    from mlxspec.server.tools import ToolCall

    assert ToolCall.parse('{"name": "f", "arguments": {"a": 1.5e300}}').arguments == {"a": 1.5e300}
    for arguments in ('{"a": NaN}', '{"a": -Infinity}', '{"a": 1e309}', '{"a": %s}' % LONG, '"{\\"a\\": NaN}"'):
        assert ToolCall.parse('{"name": "f", "arguments": %s}' % arguments) is None, arguments


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": USER + [
        {"role": "assistant", "content": [{"type": "\n\nHuman: hi", "text": "x"}]}]},
     "content block type '\\n\\nHuman: hi'"),
    ("/v1/chat/completions", {"model": "a\nb", "messages": USER}, "model 'a\\nb'"),
    ("/api/chat", {"model": "a\u2028b\x00", "messages": USER}, "model 'a\\u2028b\\x00'"),
])
def test_what_an_error_echoes_stays_on_one_line(served, path, body, needle):
    status, answer, _ = _post(served, path, json.dumps(body))
    assert status in (400, 404) and needle in error_message(surface_of(path), answer)


def test_an_error_message_is_one_line_and_encodable():
    from mlxspec.server.common import error_body

    body = error_body("openai", 400, "model 'a\ud800\nb' is not served here", "invalid_request_error", "a\udfff")
    assert body["error"]["message"] == "model 'a\\ud800\\nb' is not served here"
    assert body["error"]["param"] == "a\\udfff"
    json.dumps(body, ensure_ascii=False).encode()


def _not_utf8(body: dict, encoding: str = "utf-16-le") -> bytes:
    """BODY in UTF-16 or UTF-32 (Python's json reads both, decoding with surrogatepass), a lone
    surrogate as a raw code unit: the body's checks (json_limits) read UTF-8 escapes and bytes."""
    return json.dumps(body, ensure_ascii=False).encode(encoding, "surrogatepass")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": SURROGATE, "messages": USER}),
    ("/api/chat", {"model": MODEL, "messages": USER, "options": {SURROGATE: 1}}),
    ("/v1/messages", {"model": SURROGATE, "max_tokens": 2, "messages": USER}),
])
def test_an_error_echoing_a_lone_surrogate_is_a_4xx(served, path, body):
    """What an error message echoes (a model name, a key) was a 500 when it held a lone surrogate."""
    status, content_type, data, _ = Connection(served).post(path, _not_utf8(body), "application/json")
    assert 400 <= status < 500 and fault(path, status, content_type, data) is None, data


# A body in UTF-16 or UTF-32 (Python's parser reads both) carried lone surrogates past the UTF-8
# checks to the tokenizer and the regex compiler (500s): it is refused, as RFC 8259 wants UTF-8
@pytest.mark.parametrize("path,body,encoding", [
    ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}, "utf-16-le"),
    ("/v1/chat/completions", {"messages": USER, "guided_regex": SURROGATE, "max_tokens": 2}, "utf-16"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": USER + [{"role": "assistant",
                                                                           "content": SURROGATE}]}, "utf-32"),
    ("/api/generate", {"model": MODEL, "prompt": SURROGATE, "raw": True, "stream": False}, "utf-16-be"),
])
def test_a_body_not_in_utf8_is_refused(served, path, body, encoding):
    status, content_type, data, _ = Connection(served).post(path, _not_utf8(body, encoding), "application/json")
    assert status == 400 and fault(path, status, content_type, data) is None, data
