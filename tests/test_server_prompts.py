"""`mlxspec serve`: prompts (issue 18, section 1). Malformed nested message parts are shaped 400s,
found by mutating every nested field of valid bodies to every wrong type; rendering and
tokenizing run off the event loop, bounded by the model's context and in how many run at once."""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mlxspec.api import Chunk, load
from mlxspec.engine.stats import Stats
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def spec(tiny_qwen3):
    return load(str(tiny_qwen3))


class Instant:
    """The worker's model: one token at once (the fuzzing is about requests, not generation)."""

    def stream(self, prompt, request):
        yield Chunk(text="a", tokens=[1], stats=Stats())


@pytest.fixture(scope="module")
def served(spec):
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=64, max_queue=8))
    app.state.server.worker.spec = Instant()
    with running(app) as url:
        yield url, app


def _shaped_4xx(r: httpx.Response, anthropic: bool) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    body = r.json()
    if anthropic:
        assert body["type"] == "error" and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["code"] == r.status_code
    assert "Traceback" not in r.text and "/mlxspec/" not in r.text


# -- the six 500s of issue 18 ----------------------------------------------------------------

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
    ("/v1/chat/completions", {"messages": HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": "f"}]}]}),
    ("/v1/chat/completions", {"messages": HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": 7}]}]}),
    ("/v1/messages", {"model": "tiny", "messages": HELLO + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": 3, "signature": ""},
                                          {"type": "text", "text": "hi"}]}]}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": HELLO + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": ["x"]},
                                          {"type": "text", "text": "hi"}]}]}),
])
def test_malformed_message_parts_are_shaped_400s(served, path, body):
    url, _ = served
    r = httpx.post(url + path, json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400
    _shaped_4xx(r, anthropic=path.startswith("/v1/messages"))


# -- fuzzing inside nested parts -------------------------------------------------------------

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
CHAT = {"max_tokens": 1, "temperature": 0, "messages": [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL], "reasoning_content": "hmm"},
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18 C"},
    {"role": "user", "content": "Thanks"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                "parameters": {"type": "object", "properties": {}}}}],
    "tool_choice": "auto", "stream_options": {"include_usage": True}, "chat_template_kwargs": {"x": 1},
    "reasoning": {"enabled": True, "effort": "low"}, "speculation": {"drafter": "pld", "depth": 2}}
MESSAGES = {"model": "tiny", "max_tokens": 1, "temperature": 0,
            "system": [{"type": "text", "text": "Be brief."}], "messages": [
    {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "P"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18 C"}],
         "is_error": False},
        {"type": "text", "text": "Thanks"}]}],
    "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 10},
    "stop_sequences": ["x"], "metadata": {"user_id": "u"}, "speculation": {"enabled": True}}
WRONG = [None, 0, -1, 2.5, True, "", "x", [], [1], {}, {"a": 1}]


def _paths(value, at=()):
    """Every path below the top level of a JSON value (the top level is the schema fuzzer's)."""
    if len(at) > 1:
        yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        yield from _paths(sub, at + (key,))


def _mutated(body: dict, path: tuple, wrong):
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = wrong
    return out


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES),
                                        ("/v1/messages/count_tokens", MESSAGES)])
def test_wrong_types_inside_nested_parts_never_get_a_server_error(served, path, base):
    url, _ = served
    anthropic = path.startswith("/v1/messages")
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post(path, json=base).status_code == 200
        cases = [(at, wrong) for at in _paths(base) for wrong in WRONG]
        for at, wrong in cases:
            r = client.post(path, json=_mutated(base, at, wrong))
            assert r.status_code < 500, (at, wrong, r.status_code, r.text[:300])
            if r.status_code != 200:
                _shaped_4xx(r, anthropic)
    assert len(cases) > 300


# -- tokenizing off the event loop -----------------------------------------------------------

class SlowPrompts:
    """The served model, but rendering and tokenizing block for DELAY seconds (a huge prompt),
    and how many ran at once is counted."""

    def __init__(self, spec, delay: float):
        self._spec, self.delay, self.running, self.most, self.calls = spec, delay, 0, 0, 0
        self._lock = threading.Lock()
        outer = self

        class Tokenizer:
            def __getattr__(self, name):
                return getattr(spec.tokenizer, name)

            def encode(self, *args, **kwargs):
                return outer._blocking(spec.tokenizer.encode, *args, **kwargs)

        self.tokenizer = Tokenizer()

    def __getattr__(self, name):
        return getattr(self._spec, name)

    def _blocking(self, fn, *args, **kwargs):
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delay)
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self.running -= 1

    def encode(self, *args, **kwargs):
        return self._blocking(self._spec.encode, *args, **kwargs)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 1}),
    ("/v1/messages", {"model": "tiny", "messages": HELLO, "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": HELLO}),
])
def test_tokenizing_does_not_hold_up_other_requests(spec, path, body):
    slow = SlowPrompts(spec, delay=1.5)
    app = create_app(slow, Settings(model_name="tiny", max_tokens_cap=64))
    app.state.server.worker.spec = Instant()
    with running(app) as url:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url + path, json=body, timeout=30)
            assert _until(lambda: slow.running == 1)
            t0 = time.perf_counter()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            waited = time.perf_counter() - t0
            assert pending.result().status_code == 200
    assert waited < 0.75, f"/health waited {waited:.2f} s behind a tokenization"


def test_prompt_work_is_bounded_and_the_excess_is_503(spec):
    slow = SlowPrompts(spec, delay=0.6)
    app = create_app(slow, Settings(model_name="tiny", max_queue=1))
    with running(app) as url:
        body = {"model": "tiny", "messages": HELLO}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/messages/count_tokens", json=body,
                                                          timeout=30), range(8)))
    codes = sorted(r.status_code for r in answers)
    assert slow.most <= app.state.server.prompts.workers
    assert 503 in codes and 200 in codes, codes
    busy = next(r for r in answers if r.status_code == 503)
    assert busy.json()["error"]["type"] == "overloaded_error" and busy.headers["retry-after"] == "1"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/v1/messages/count_tokens"])
def test_text_beyond_the_context_is_refused_before_tokenizing(spec, path):
    slow = SlowPrompts(spec, delay=0)
    app = create_app(slow, Settings(model_name="tiny", max_tokens_cap=64, max_body_bytes=16 << 20))
    limit = app.state.server.prompts.max_chars
    longest = max(len(t) for t in spec.tokenizer.get_vocab())
    assert limit == spec.target.context_length * longest
    text = "word " * (limit // 5 + 1)
    body = ({"prompt": text, "max_tokens": 1} if path == "/v1/completions" else
            {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
    with running(app) as url:
        r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400 and "context" in r.text
    assert slow.calls == 0


def _until(check, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()
