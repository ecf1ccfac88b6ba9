"""What wraps every request, whichever surface answers it: the body-size limit, the Host and
API key checks and request counting, and errors shaped the way the request's surface expects them.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..options import BODY_TIMEOUT, DEFAULT_MAX_BUFFERED_BYTES, PARSE_OFF_LOOP_BYTES
from .common import APIError, error_body, surface_of
from .contract import UNKNOWN_FIELD, unknown_field_message
from .json_limits import json_fault
from .parsing import parser_slot
from .ui import is_ui_path

log = logging.getLogger("mlxspec.server")

# answered without an API key: a load balancer's health check, the API's own documentation
OPEN_PATHS = {"/health", "/docs", "/openapi.json", "/redoc"}

# the error type each surface expects for an HTTP status the framework raises itself
ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               413: "request_too_large",
               422: "invalid_request_error", 503: "overloaded_error"}


# endpoints of the real APIs this server does not offer (-> why): a 501 that says so, not a bare 404
ONE_MODEL = "it serves the one model it was started with"
UNSUPPORTED_ROUTES = {
    **{f"/api/{name}": ONE_MODEL for name in ("pull", "push", "create", "copy", "delete", "blobs")},
    **{path: "it serves a text generation model, not embeddings" for path in
       ("/api/embed", "/api/embeddings", "/v1/embeddings")},
}


# the routes whose bodies are JSON, whatever Content-Type a client sends (as Ollama and
# llama-server take them: curl -d sends application/x-www-form-urlencoded, docs/server.md's and
# Ollama's curl examples send no type at all, and FastAPI would read neither as JSON)
JSON_ROUTES = ("/v1/", "/api/")


def _as_json(scope: dict) -> dict:
    """SCOPE of a request with a body to a JSON route, its Content-Type made JSON's."""
    if not scope.get("path", "").startswith(JSON_ROUTES):
        return scope
    headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
    kept = dict(scope.get("headers") or []).get(b"content-type", b"")
    is_json = kept.split(b";")[0].strip().lower().endswith((b"/json", b"+json"))
    return scope if is_json else {**scope, "headers": headers + [(b"content-type", b"application/json")]}


class BufferBudget:
    """Bytes of request bodies buffered at once, all requests together, up to LIMIT."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class BodyRefused(Exception):
    """A body not read to its end; its args are BodyLimit._refuse's, from the status on."""


class BodyLimit:
    """ASGI middleware: a request body is read here, then handed on. Over LIMIT bytes, declared
    (Content-Length) or not (chunked), it is a 413 before it is parsed; not in within
    BODY_TIMEOUT seconds, a 408; one that would take the bodies buffered at once past BUDGET
    bytes, a 503 with Retry-After. JSON no surface could take (too deeply nested, lone
    surrogates: json_limits) is a 400, checked on a worker thread for a large body. A body is
    JSON whatever its Content-Type says (curl -d sends a form's type): the type is set to JSON.
    An exception no handler took is a shaped 500 here, so uvicorn keeps the connection."""

    def __init__(self, app, limit: int, budget: BufferBudget | None = None, body_timeout: float = BODY_TIMEOUT):
        self.app, self.limit, self.body_timeout = app, limit, body_timeout
        self.budget = budget or BufferBudget(DEFAULT_MAX_BUFFERED_BYTES)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, send, *self._too_large().args)
        try:
            first = await self._read_body(receive)
        except BodyRefused as refused:
            return await self._refuse(scope, send, *refused.args)
        if first["type"] == "http.request" and first["body"]:
            fault = await self._json_fault(first["body"])
            if fault is not None:
                return await self._refuse(scope, send, 400, fault.message, fault.kind, fault.param, close=False)
            scope = _as_json(scope)

        async def replayed():
            nonlocal first
            if first is not None:
                message, first = first, None  # the body is the app's now: no reference kept here
                return message
            return await receive()  # then what follows: a disconnect, when the client leaves

        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replayed, watched)
        except Exception:
            # Starlette's outermost handler answers a 500 and raises on, and uvicorn closes a
            # connection whose app raised: the client's next request on it would fail too
            if started:
                raise  # a stream broken halfway: closing the connection is all that is left
            log.exception("internal error on %s", scope.get("path", ""))
            await self._refuse(scope, send, 500, "internal server error", "api_error", close=False)

    async def _read_body(self, receive) -> dict:
        """The request's whole body as one message (or the disconnect that came instead); the
        bytes count against the budget while they arrive, and are in one buffer, each chunk
        dropped as soon as it is copied (many small allocations would stay with the process)."""
        buffer = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left while sending
                        return message
                    chunk = message.get("body", b"")
                    if len(buffer) + len(chunk) > self.limit:
                        raise self._too_large()
                    if not self.budget.take(len(chunk)):
                        raise BodyRefused(503, "the server holds too many request bodies now; retry shortly",
                                          "overloaded_error", None, True, [(b"retry-after", b"1")])
                    buffer += chunk
                    if not message.get("more_body"):
                        return {"type": "http.request", "body": bytes(buffer), "more_body": False}
                    del message, chunk
        except TimeoutError:
            raise BodyRefused(408, f"the request body did not arrive within {self.body_timeout:g} s",
                              "invalid_request_error") from None
        finally:
            self.budget.give(len(buffer))

    async def _json_fault(self, body: bytes):
        if len(body) < PARSE_OFF_LOOP_BYTES:
            return json_fault(body)
        return await anyio.to_thread.run_sync(json_fault, body, limiter=parser_slot())

    def _too_large(self) -> BodyRefused:
        """The 413 of a body over the limit, declared or counted as it arrives."""
        return BodyRefused(413, f"request body over {self.limit} bytes", "request_too_large")

    @staticmethod
    async def _refuse(scope, send, status: int, message: str, kind: str, param: str | None = None,
                      close: bool = True, extra: list | None = None):
        """Answer STATUS in the surface's error shape (with the EXTRA headers); CLOSE: and end the
        connection (its body may be unread)."""
        body = json.dumps(error_body(surface_of(scope.get("path", "")), status, message, kind, param)).encode()
        headers = [(b"content-type", b"application/json")] + ([(b"connection", b"close")] if close else [])
        headers += extra or []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _is_loopback(name: str) -> bool:
    if name.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name in a Host header: ``[::1]:8000`` -> ``::1``, ``localhost:80`` -> ``localhost``."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Gate:
    """ASGI middleware, a pure one: a client that leaves reaches the request (an
    ``@app.middleware("http")`` one hides it, and abandoned requests would run on). Without an
    API key on a loopback address only loopback Host names are served (a page the browser got
    from a rebound DNS name must not reach the API); with a key, requests without it are a 401.
    Every answer under /v1/ and /api/ is counted by surface and status."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        surface = surface_of(path)
        refusal = self.refusal(scope)
        if refusal is not None:
            status, message, kind = refusal
            self.server.metrics.observe(surface, status)
            response = JSONResponse(error_body(surface, status, message, kind), status_code=status)
            return await response(scope, receive, send)
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, counted)
        if status is not None and path.startswith(("/v1/", "/api/")):
            self.server.metrics.observe(surface, status)

    def refusal(self, scope) -> tuple[int, str, str] | None:
        """(status, message, error type) of a request refused here; None: it goes on."""
        headers = Headers(scope=scope)
        api_key = self.server.settings.api_key
        if not api_key:
            bound = (scope.get("server") or ("", None))[0] or ""
            host = headers.get("host")
            if _is_loopback(bound) and host is not None and not _is_loopback(host_name(host)):
                return 403, ("this server, on loopback without an API key, answers only requests for localhost, "
                             "127.0.0.1 or [::1] (the Host header); set an API key to serve other names"), \
                    "permission_error"
            return None
        path = scope.get("path", "")
        if path in OPEN_PATHS or (self.server.settings.ui and is_ui_path(path)):
            return None  # the chat page asks for the key itself
        given = headers.get("x-api-key") or ""
        bearer = headers.get("authorization") or ""
        if bearer.lower().startswith("bearer "):
            given = given or bearer[7:].strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            return 401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)", \
                "authentication_error"
        return None


async def api_error(request: Request, err: APIError):
    return JSONResponse(error_body(surface_of(request.url.path), err.status, err.message, err.kind, err.param),
                        status_code=err.status, headers=err.headers)


async def invalid_request(request: Request, err: RequestValidationError):
    """A body the schema refuses: a 400 naming the first field at fault (not FastAPI's 422)."""
    first = err.errors()[0] if err.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        message, where = "the request body is not valid JSON", None
    elif first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        message = "the request body is empty; send a JSON object"
    elif first.get("type") == UNKNOWN_FIELD:  # the field, inside the object at fault
        where = ".".join(filter(None, (where, first["ctx"]["field"])))
        message = unknown_field_message(where, first["ctx"]["hint"])
    elif first.get("type") == "extra_forbidden":  # a field of an object inside the body
        message = unknown_field_message(where or "")
    else:
        message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
    return JSONResponse(error_body(surface_of(request.url.path), 400, message, "invalid_request_error", where),
                        status_code=400)


# FastAPI's words for a body it could not decode as text (not UTF-8, or compressed)
UNDECODED_BODY = "There was an error parsing the body"


async def http_error(request: Request, err: StarletteHTTPException):
    if err.status_code == 404:  # no route matched (the surfaces answer their own 404s as APIError)
        return missing_route(request)
    kind = ERROR_KINDS.get(err.status_code, "api_error")
    message = str(err.detail)
    if err.status_code == 400 and message == UNDECODED_BODY:
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        message = (f"content-encoding {encoding} is not supported here: send the body uncompressed"
                   if encoding not in ("", "identity") else "the request body is not valid JSON in UTF-8")
    return JSONResponse(error_body(surface_of(request.url.path), err.status_code, message, kind),
                        status_code=err.status_code, headers=err.headers)  # e.g. a 405's Allow


def missing_route(request: Request) -> JSONResponse:
    """A 501 for an endpoint of a real API this server leaves out (UNSUPPORTED_ROUTES), else a 404."""
    path, surface = request.url.path, surface_of(request.url.path)
    reason = next((why for route, why in UNSUPPORTED_ROUTES.items() if path == route or path.startswith(route + "/")),
                  None)
    if reason is not None:
        status, message, kind = 501, f"{path} is not supported by this server: {reason}", "invalid_request_error"
    else:
        status, message, kind = 404, f"no endpoint {request.method} {path} on this server", "not_found_error"
    return JSONResponse(error_body(surface, status, message, kind), status_code=status)


async def internal_error(request: Request, err: Exception):
    log.exception("internal error on %s", request.url.path)
    return JSONResponse(error_body(surface_of(request.url.path), 500, "internal server error", "api_error"),
                        status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    """Every error, the framework's included, in the body format of the request's surface."""
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
