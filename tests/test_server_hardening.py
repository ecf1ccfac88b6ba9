"""`mlxspec serve` under abuse (issue 18, section 1): clients that leave, malformed nested
parts, huge prompts, a full queue, odd HTTP, tiny temperatures, DNS rebinding. A real uvicorn on
127.0.0.1 over the tiny offline model; the worker's model is swapped for a scripted one where
only the request's life matters."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from mlxspec.api import Chunk, load
from mlxspec.engine.sampling import SamplingParams
from mlxspec.engine.stats import Stats
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import running, until

HELLO = [{"role": "user", "content": "Hello"}]
BODIES = {  # a non-streaming request of each kind, asking for many tokens
    "/v1/chat/completions": {"messages": HELLO, "max_tokens": 2000},
    "/v1/completions": {"prompt": "x", "max_tokens": 2000},
    "/v1/messages": {"model": "tiny", "messages": HELLO, "max_tokens": 2000},
}


@pytest.fixture(scope="module")
def spec(tiny_qwen3):
    return load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def served(spec):
    app = create_app(spec, Settings(model_name="tiny", max_tokens_cap=4096, max_queue=8,
                                    max_body_bytes=1024 * 1024))
    with running(app) as url:
        yield url, app


class Scripted:
    """The worker's model: one "a" every DELAY seconds up to max_tokens; what each call made."""

    def __init__(self, delay: float = 0.02):
        self.delay = delay
        self.calls: list[dict] = []

    def stream(self, prompt, request):
        call = {"prompt": prompt, "made": 0, "closed": threading.Event()}
        self.calls.append(call)
        try:
            for _ in range(request.max_tokens):
                time.sleep(self.delay)
                call["made"] += 1
                yield Chunk(text="a", tokens=[1], stats=Stats())
        finally:
            call["closed"].set()


@pytest.fixture
def scripted(served, monkeypatch):
    model = Scripted()
    monkeypatch.setattr(served[1].state.server.worker, "spec", model)
    return model


def _send(url: str, path: str, body: dict, headers: dict | None = None) -> socket.socket:
    """A raw HTTP/1.1 POST whose socket the test closes when it likes (a client leaving)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(data)}"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
    return sock


# -- clients that leave ----------------------------------------------------------------------

@pytest.mark.parametrize("path", list(BODIES))
def test_an_abandoned_non_streaming_request_stops_its_generation(served, scripted, path):
    url, app = served
    sock = _send(url, path, BODIES[path])
    assert until(lambda: scripted.calls and scripted.calls[0]["made"] >= 3)
    sock.close()
    call = scripted.calls[0]
    assert call["closed"].wait(5), "the generation went on after its client left"
    assert call["made"] < 1000
    assert until(lambda: app.state.server.worker.depth == 0)


def test_a_queued_request_whose_client_left_never_runs(served, scripted):
    url, app = served
    worker = app.state.server.worker
    running_one = _send(url, "/v1/completions", {"prompt": "x", "max_tokens": 2000, "stream": True})
    assert until(lambda: scripted.calls)
    queued = _send(url, "/v1/chat/completions", BODIES["/v1/chat/completions"])
    assert until(lambda: worker.depth == 2)
    queued.close()
    assert until(lambda: worker.depth == 1), "the queued request kept its place after its client left"
    running_one.close()
    assert until(lambda: worker.depth == 0)
    time.sleep(0.2)
    assert len(scripted.calls) == 1  # the abandoned one never started


def test_max_queue_zero_lets_nothing_wait(spec, monkeypatch):
    app = create_app(spec, Settings(model_name="tiny", max_queue=0, max_tokens_cap=4096))
    model = Scripted()
    monkeypatch.setattr(app.state.server.worker, "spec", model)
    with running(app) as url:
        body = {"prompt": "x", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200  # idle: runs
        busy = _send(url, "/v1/completions", {"prompt": "x", "max_tokens": 2000, "stream": True})
        assert until(lambda: len(model.calls) == 2)
        r = httpx.post(url + "/v1/completions", json=body, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "overloaded_error"
        busy.close()
        assert until(lambda: app.state.server.worker.depth == 0)
        assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200


# -- HTTP ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_chunked_body_over_the_limit_is_413(served, path):
    url, _ = served

    def chunks():
        for _ in range(24):
            yield b"x" * 65536  # 1.5 MiB, no Content-Length

    r = httpx.post(url + path, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    body = r.json()
    kind = body["error"]["type"]
    assert kind == "request_too_large" and "over" in body["error"]["message"]
    if path == "/v1/messages":
        assert body["type"] == "error"


def test_405_says_which_methods_are_allowed(served):
    url, _ = served
    r = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.put(url + "/v1/messages")
    assert r.status_code == 405 and "POST" in r.headers["allow"] and r.json()["type"] == "error"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example"])
def test_a_foreign_host_header_is_refused_on_loopback_without_a_key(served, host):
    url, _ = served
    r = httpx.get(url + "/v1/models", headers={"host": host})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = httpx.post(url + "/v1/messages", headers={"host": host}, json={"model": "tiny", "max_tokens": 1,
                                                                        "messages": HELLO})
    assert r.status_code == 403 and r.json()["type"] == "error"


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "127.0.0.1", "127.0.0.1:80", "[::1]",
                                  "[::1]:8000"])
def test_loopback_host_headers_are_served(served, host):
    url, _ = served
    assert httpx.get(url + "/v1/models", headers={"host": host}).status_code == 200


def test_with_a_key_the_host_header_is_not_checked(spec):
    app = create_app(spec, Settings(model_name="tiny", api_key="k"))
    with running(app) as url:
        r = httpx.get(url + "/v1/models", headers={"host": "evil.example", "authorization": "Bearer k"})
        assert r.status_code == 200
        assert httpx.get(url + "/v1/models", headers={"host": "evil.example"}).status_code == 401


# -- sampling --------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [5e-324, 1e-300, 1e-40])
def test_a_vanishing_temperature_is_greedy(served, t):
    assert SamplingParams(temperature=t).greedy
    url, _ = served
    body = {"prompt": "def add(a, b):\n    return", "max_tokens": 12, "speculation": {"enabled": False}}
    greedy = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=30).json()
    tiny = httpx.post(url + "/v1/completions", json={**body, "temperature": t}, timeout=30).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


# -- the prompt cache's memory ---------------------------------------------------------------

@pytest.mark.parametrize("drafter", ["pld", "draft"])
def test_the_prompt_cache_counts_the_memory_it_holds(tiny_qwen3, tiny_qwen3_draft, drafter):
    """What the cache says it holds is what clearing it gives back (the budget means memory).
    Prompts of 100+ tokens: every array is over 4 KiB, which the allocator does not round up."""
    import gc

    import mlx.core as mx

    spec = load(str(tiny_qwen3), draft_model=str(tiny_qwen3_draft) if drafter == "draft" else None)
    for i in range(3):
        spec.generate(f"Hello {i}, " + "tell me about caches. " * 16, max_tokens=8, temperature=0, drafter=drafter)
    cache = spec.prompt_cache
    entries = list(cache._entries.values())
    assert entries and (drafter != "draft" or all(e.drafters for e in entries))
    gc.collect()
    counted, tokens = cache.nbytes, sum(e.tokens.nbytes for e in entries)
    before = mx.get_active_memory()
    del entries
    cache.clear()
    gc.collect()
    freed = before - mx.get_active_memory()
    assert freed > 0 and abs((counted - tokens) - freed) <= 0.02 * freed, (counted, tokens, freed)


# -- shutdown --------------------------------------------------------------------------------

ENDLESS = """
import sys, time
from mlxspec.api import Chunk
from mlxspec.engine.stats import Stats
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from mlxspec.server.lifecycle import serve

class Target:
    vocab_size, context_length = 100, None

class Endless:
    tokenizer, target, prompt_cache = None, Target(), None

    def stream(self, prompt, request):
        while True:
            time.sleep(0.02)
            yield Chunk(text="a", tokens=[1], stats=Stats())

serve(create_app(Endless(), Settings(model_name="m", max_tokens_cap=10**6)), "127.0.0.1", int(sys.argv[1]),
      log_level="warning", grace=float(sys.argv[2]))
"""


def _serving(grace: float):
    import subprocess
    import sys

    from server_helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", ENDLESS, str(port), str(grace)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _streams(url: str, n: int) -> list[socket.socket]:
    assert until(lambda: _healthy(url), 30), "the server did not start"
    socks = [_send(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 10**6, "stream": True})
             for _ in range(n)]
    assert socks[0].recv(64).startswith(b"HTTP/1.1 200")  # generating; the others wait in the queue
    return socks


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_drains_for_a_bounded_time_and_a_second_one_stops_now():
    import signal

    bounded, bounded_url = _serving(grace=1.0)
    patient, patient_url = _serving(grace=120.0)
    try:
        held = _streams(bounded_url, 3) + _streams(patient_url, 3)
        t0 = time.monotonic()
        bounded.send_signal(signal.SIGTERM)
        patient.send_signal(signal.SIGTERM)
        assert bounded.wait(15) == 0, bounded.stdout.read()  # a drain that ends is a clean exit
        assert time.monotonic() - t0 < 1.0 + 5
        assert b"the server is shutting down" in _read_all(held[0])  # in-band, the stream had started
        assert _read_all(held[1]).startswith(b"HTTP/1.1 503")  # it was waiting: a plain 503
        time.sleep(0.3)
        assert patient.poll() is None  # still draining its streams
        patient.send_signal(signal.SIGTERM)
        t1 = time.monotonic()
        patient.wait(15)
        assert time.monotonic() - t1 < 5
        for s in held:
            s.close()
    finally:
        for p in (bounded, patient):
            if p.poll() is None:
                p.kill()
                p.wait()
