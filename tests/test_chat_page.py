"""The chat page `mlxspec serve` shows a browser at / (mlxspec/server/ui.py, static/) and the
stream extension it reads (stream_options.include_speculation: which text came from accepted
draft tokens). ASGI tests over the built-in demo model, then the page itself in a real headless
Chromium (Debian's `chromium`, driven by Playwright) against a real `mlxspec serve`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from mlxspec.api import load
from mlxspec.server.app import create_app
from mlxspec.server.common import Settings
from server_helpers import free_port, until

STATIC = Path(__file__).resolve().parents[1] / "mlxspec" / "server" / "static"
HTML = {"accept": "text/html,application/xhtml+xml"}
ECHO = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. "
                                    "the quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def demo():
    return load(None)


def _client(spec, **settings) -> TestClient:
    return TestClient(create_app(spec, Settings(model_name=spec.name, **settings)))


def _events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_the_page_and_its_files_are_served_without_a_key_and_load_nothing_from_elsewhere(demo):
    client = _client(demo, api_key="sekrit")
    page = client.get("/", headers=HTML)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for name in ("chat.js", "chat.css"):
        assert client.get(f"/ui/{name}").status_code == 200 and f"/ui/{name}" in page.text
    info = client.get("/ui/info").json()
    assert info["model"] == demo.name and info["needs_key"] is True and info["drafter"] == "auto"
    # the API itself still needs the key; Ollama's clients still find "Ollama is running" at /
    assert client.post("/v1/chat/completions", json={"messages": ECHO}).status_code == 401
    assert client.get("/").text == "Ollama is running"
    files = {p.name: p.read_text() for p in STATIC.iterdir()}
    assert set(files) >= {"index.html", "chat.js", "chat.css"}
    for name, text in files.items():
        assert not re.search(r"(https?:)?//[a-z0-9]", text.replace("// ", "")), name  # no URL of another origin
        assert "innerHTML" not in text and "eval(" not in text, name


def test_only_the_static_files_are_served(demo):
    client = _client(demo)
    for path in ("/ui/../app.py", "/ui/..%2Fapp.py", "/ui/%2e%2e/common.py", "/ui/ui.py", "/ui/nothing.js",
                 "/ui/static", "/ui/__init__.py"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert "import" not in r.text, path


def test_no_ui_leaves_the_root_as_it_was(demo):
    off = _client(demo, ui=False, api_key="sekrit")
    assert off.get("/ui/chat.js").status_code == 401  # not open without the page: gated like the rest
    assert off.get("/ui/info", headers={"authorization": "Bearer sekrit"}).status_code == 404
    assert off.get("/", headers={**HTML, "authorization": "Bearer sekrit"}).text == "Ollama is running"
    assert _client(demo, ui=False).get("/ui/chat.js").status_code == 404


def test_serve_turns_the_page_on_for_loopback_only_unless_asked(monkeypatch):
    from typer.testing import CliRunner

    from mlxspec import cli
    from mlxspec.cli import serve

    seen = []

    def build(model, draft_model, cache_bytes, max_connections, max_batch, **settings):
        seen.append(settings["ui"])
        raise SystemExit(0)

    monkeypatch.setattr(serve, "_build_app", build)
    monkeypatch.setenv("MLXSPEC_API_KEY", "k")
    for args, expected in ((["--host", "127.0.0.1"], True), (["--host", "0.0.0.0"], False),
                           (["--host", "0.0.0.0", "--ui"], True), (["--host", "127.0.0.1", "--no-ui"], False)):
        CliRunner().invoke(cli.app, ["serve", *args, "--port", str(free_port())])
        assert seen[-1] is expected, args


def _stream(client, **extra) -> list[dict]:
    body = {"messages": ECHO, "stream": True, "temperature": 0, "max_tokens": 80,
            "speculation": {"drafter": "pld"}, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return _events(r)


def test_include_speculation_marks_the_text_of_accepted_drafts(demo):
    client = _client(demo)
    # what the accepted draft tokens of each engine step decode to, from the engine itself
    ids = client.app.state.server.encode_chat(ECHO)
    expected, accepted = [], 0
    for chunk in demo.stream(ids, max_tokens=80, temperature=0, drafter="pld"):
        a, accepted = chunk.stats.accepted - accepted, chunk.stats.accepted
        if a:
            expected.append(demo.tokenizer.decode(chunk.tokens[:a]))
    assert accepted > 5  # the demo model copies from its prompt: pld's drafts are taken
    events = _stream(client, stream_options={"include_usage": True, "include_speculation": True})
    drafted, text = [], ""
    for e in events:
        if not e.get("choices") or "content" not in e["choices"][0]["delta"] or not e["choices"][0]["delta"]["content"]:
            continue
        piece = e["choices"][0]["delta"]["content"]
        spans = e["x_mlxspec"]["drafted"]
        assert all(0 <= a < b <= len(piece) for a, b in spans) and spans == sorted(spans)
        drafted += [piece[a:b] for a, b in spans]
        text += piece
    assert "".join(drafted) == "".join(expected)
    usage = events[-1]["usage"]["speculation"]
    assert usage["accepted"] == accepted
    last = [e for e in events if "x_mlxspec" in e][-1]["x_mlxspec"]
    assert last["accepted_tokens"] <= accepted and last["completion_tokens"] <= 80


def test_the_stream_is_unchanged_without_the_option_and_unknown_options_are_refused(demo):
    client = _client(demo)
    plain = _stream(client, stream_options={"include_usage": True})
    marked = _stream(client, stream_options={"include_usage": True, "include_speculation": True})
    assert not any("x_mlxspec" in e for e in plain)

    def stripped(events):
        return [{k: v for k, v in e.items() if k not in ("id", "created", "x_mlxspec", "usage")} for e in events]

    assert stripped(plain) == stripped(marked)
    r = client.post("/v1/chat/completions", json={"messages": ECHO, "stream": True,
                                                   "stream_options": {"include_speculations": True}})
    assert r.status_code == 400 and "include_speculations" in r.json()["error"]["message"]


def test_marks_skip_the_reasoning_tags():
    from mlxspec.server.common import DraftMarks, Outcome

    outcome = Outcome(text="<think>\nab</think>\n\nk drafted")
    outcome.add_drafted(9, 10)  # "b"
    outcome.add_drafted(20, 28)  # "k drafte"
    marks = DraftMarks(outcome)
    assert marks.of("ab")["drafted"] == [[1, 2]]
    assert marks.of("k drafted")["drafted"] == [[0, 8]]


# --- the page in a real browser ------------------------------------------------------------


@pytest.fixture(scope="module")
def served_page():
    """A real `mlxspec serve` of the demo model on a free loopback port: its URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "mlxspec", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--drafter", "pld"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        assert until(up, 60) and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else "no start"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        banner = proc.stdout.read()
        assert f"chat page: open {url}/" in banner, banner[-2000:]


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium): the page is not tried in a browser")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def _wait(check, seconds: float, what: str) -> None:
    """Poll CHECK (the page's CSP allows no eval: Playwright's wait_for_function cannot run)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _status_says(page, word: str, seconds: float = 20) -> None:
    _wait(lambda: word in page.text_content("#status"), seconds, f"status {word!r}")


def _send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_the_page_streams_marks_drafts_and_stops(served_page, browser, tmp_path):
    url = served_page
    page = browser.new_page(viewport={"width": 1000, "height": 800})
    problems = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.goto(url + "/")
    _wait(lambda: page.text_content("#model") == "mlxspec-demo", 10, "the header")
    assert page.is_hidden("#keybar")
    assert "pld" in page.text_content("#drafter")

    # a prompt the demo model copies from: text streams in, drafted text is marked
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "80")
    _send(page, ECHO[0]["content"])
    _status_says(page, "finished")
    reply = page.locator(".message.assistant .content").last
    assert len(reply.text_content()) > 40
    assert page.locator(".message.assistant .content .drafted").count() > 0
    status = page.text_content("#status")
    assert "80 tokens" in status and "tok/s" in status and "acceptance" in status, status
    page.screenshot(path=str(Path(os.environ.get("MLXSPEC_SCREENSHOT_DIR", tmp_path)) / "chat_page.png"),
                    full_page=True)

    # Stop during a long generation: the server cancels it, the worker is free for the next
    page.fill("#max-tokens", "4000")
    _send(page, "Write a very long story about a fox.")
    second = page.locator(".message.assistant .content").nth(1)
    _wait(lambda: len(second.text_content()) > 20, 20, "the long reply")
    assert httpx.get(url + "/health").json()["queue_depth"] == 1
    page.click("#stop")
    _status_says(page, "stopped", 5)
    assert until(lambda: httpx.get(url + "/health").json()["queue_depth"] == 0, 5)
    page.fill("#max-tokens", "8")
    _send(page, "Hello")
    _status_says(page, "finished")
    assert page.locator(".message.assistant").count() == 3
    assert not problems, problems
    page.close()


def test_the_page_asks_for_the_key_the_server_needs(demo, browser):
    from server_helpers import running

    app = create_app(demo, Settings(model_name=demo.name, api_key="sekrit", drafter="pld"))
    with running(app) as url:
        page = browser.new_page()
        problems = []
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.goto(url + "/")
        _wait(lambda: page.is_visible("#keybar"), 10, "the key field")
        page.fill("#max-tokens", "4")
        _send(page, "Hello")  # no key yet: the server's 401 is shown, the turn not kept
        _status_says(page, "error")
        assert "API key" in page.locator(".message.assistant .note").last.text_content()
        page.fill("#key", "sekrit")
        page.click("#keybar button")
        _send(page, "Hello")
        _status_says(page, "finished")
        assert page.evaluate("sessionStorage.length") == 1
        assert not problems, problems
        page.close()
