"""A tiny Hugging Face Hub on 127.0.0.1, enough for ``huggingface_hub.snapshot_download`` (2.x).

Endpoints (what huggingface_hub 2.4 requests):

* ``GET /api/models/{repo}/revision/{rev}`` -> model info (``sha``, ``siblings``)
* ``GET /api/models/{repo}/tree/{rev}?recursive=...`` -> file list (``type``, ``path``, ``size``, ``oid``)
* ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` -> ETag, X-Repo-Commit, Content-Length; ``Range``
  answered with 206

Errors follow the real hub: an unknown repo is 404 with ``X-Error-Code: RepoNotFound``; a gated
repo without ``Authorization`` is 401 with ``X-Error-Code: GatedRepo``.
Fault injection: ``cut_once`` (file names whose first GET stops half-way, connection closed) and
``fail_once`` (file names whose first GET is a 500).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class FakeRepo:
    # revision name (branch) -> commit sha; commit sha -> {path: bytes}
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated: bool = False


def _sha(seed: str) -> str:
    return hashlib.sha1(seed.encode()).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, lower-cased headers)
        self.cut_once: set[str] = set()
        self.fail_once: set[str] = set()
        self.token = "hf_fake_token"
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- content ----------------------------------------------------------------------------

    def add_folder(self, repo_id: str, folder, *, revision: str = "main", gated: bool = False,
                   extra: dict[str, bytes] | None = None) -> str:
        """Publish every file under ``folder`` (plus ``extra``) as a new commit on ``revision``."""
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        files.update(extra or {})
        return self.add_files(repo_id, files, revision=revision, gated=gated)

    def add_files(self, repo_id: str, files: dict[str, bytes], *, revision: str = "main",
                  gated: bool = False) -> str:
        repo = self.repos.setdefault(repo_id, FakeRepo())
        repo.gated = repo.gated or gated
        digest = hashlib.sha1(repo_id.encode() + revision.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha1(files[name]).digest())
        commit = digest.hexdigest()
        repo.commits[commit] = dict(files)
        repo.branches[revision] = commit
        return commit

    def gets(self, suffix: str) -> list[dict]:
        """Headers of the GET requests for a file path ending in ``suffix``."""
        return [h for m, p, h in self.requests if m == "GET" and "/resolve/" in p and p.endswith(suffix)]

    # -- HTTP -------------------------------------------------------------------------------

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, head=True)

            def do_GET(self):
                hub._serve(self, head=False)

        return Handler

    def _send(self, h, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        h.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Length", str(len(body)))
        for key, value in headers.items():
            h.send_header(key, value)
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _json(self, h, obj, head=False) -> None:
        self._send(h, 200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _error(self, h, status: int, code: str, message: str, head=False) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(h, status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                     "X-Error-Message": message}, head)

    def _lookup(self, h, repo_id: str, rev: str, head: bool):
        """(repo, commit, files) or None after answering with the error."""
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", "Repository not found", head)
            return None
        if repo.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted.", head)
            return None
        commit = repo.branches.get(rev, rev if rev in repo.commits else None)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return None
        return repo, commit, repo.commits[commit]

    def _serve(self, h, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        with self._lock:
            self.requests.append((h.command, path, {k.lower(): v for k, v in h.headers.items()}))
        if m := re.fullmatch(r"/api/models/(.+?)/revision/([^/]+)", path):
            found = self._lookup(h, m.group(1), m.group(2), head)
            if found:
                _, commit, files = found
                self._json(h, {"id": m.group(1), "modelId": m.group(1), "sha": commit, "private": False,
                               "siblings": [{"rfilename": f} for f in sorted(files)]}, head)
            return
        if m := re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(/.*)?", path):
            found = self._lookup(h, m.group(1), m.group(2), head)
            if found:
                _, _, files = found
                entries, folders = [], set()
                for name in sorted(files):
                    parts = name.split("/")
                    folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
                    entries.append({"type": "file", "path": name, "size": len(files[name]),
                                    "oid": hashlib.sha1(files[name]).hexdigest()})
                entries += [{"type": "directory", "path": d, "oid": _sha(d)} for d in sorted(folders)]
                self._json(h, entries, head)
            return
        if m := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
            found = self._lookup(h, m.group(1), m.group(2), head)
            if not found:
                return
            _, commit, files = found
            name = m.group(3)
            if name not in files:
                self._error(h, 404, "EntryNotFound", f"{name} does not exist", head)
                return
            self._file(h, commit, name, files[name], head)
            return
        self._error(h, 404, "RepoNotFound", "not found", head)

    def _file(self, h, commit: str, name: str, data: bytes, head: bool) -> None:
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": commit,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if head:
            self._send(h, 200, data, headers, head=True)
            return
        with self._lock:
            fail = name in self.fail_once
            cut = name in self.cut_once
            self.fail_once.discard(name)
            self.cut_once.discard(name)
        if fail:
            self._error(h, 500, "InternalError", "injected failure")
            return
        start = 0
        rng = h.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = int(m.group(1))
        body = data[start:]
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(body))
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.end_headers()
        if cut:  # half the body, then drop the connection
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(body)
