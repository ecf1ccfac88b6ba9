"""What wraps every request, whichever surface answers it: the body-size limit, the API key
check and request counting, and errors shaped the way the request's surface expects them.
"""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .common import APIError, error_body, surface_of

log = logging.getLogger("mlxspec.server")

# answered without an API key: a load balancer's health check, the API's own documentation
OPEN_PATHS = {"/health", "/docs", "/openapi.json", "/redoc"}

# the error type each surface expects for an HTTP status the framework raises itself
ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
               503: "overloaded_error"}


class BodyLimit:
    """ASGI middleware: a request body over the limit is answered 413 before it is parsed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(scope, send)

    async def _reject(self, scope, send):
        surface = surface_of(scope.get("path", ""))
        body = json.dumps(error_body(surface, 413, f"request body over {self.limit} bytes",
                                     "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


async def check_key_and_count(request: Request, call_next):
    """HTTP middleware: a request without the server's API key (when it has one) is a 401;
    every answer under /v1/ is counted by surface and status."""
    server = request.app.state.server
    surface = surface_of(request.url.path)
    api_key = server.settings.api_key
    if api_key and request.url.path not in OPEN_PATHS:
        given = request.headers.get("x-api-key") or ""
        bearer = request.headers.get("authorization") or ""
        if bearer.lower().startswith("bearer "):
            given = given or bearer[7:].strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            server.metrics.observe(surface, 401)
            return JSONResponse(error_body(surface, 401, "invalid or missing API key "
                                           "(Authorization: Bearer KEY or x-api-key: KEY)",
                                           "authentication_error"), status_code=401)
    response = await call_next(request)
    if request.url.path.startswith("/v1/"):
        server.metrics.observe(surface, response.status_code)
    return response


async def api_error(request: Request, err: APIError):
    return JSONResponse(error_body(surface_of(request.url.path), err.status, err.message, err.kind, err.param),
                        status_code=err.status, headers=err.headers)


async def invalid_request(request: Request, err: RequestValidationError):
    """A body the schema refuses: a 400 naming the first field at fault (not FastAPI's 422)."""
    first = err.errors()[0] if err.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        message, where = "the request body is not valid JSON", None
    else:
        message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
    return JSONResponse(error_body(surface_of(request.url.path), 400, message, "invalid_request_error", where),
                        status_code=400)


async def http_error(request: Request, err: StarletteHTTPException):
    kind = ERROR_KINDS.get(err.status_code, "api_error")
    return JSONResponse(error_body(surface_of(request.url.path), err.status_code, str(err.detail), kind),
                        status_code=err.status_code)


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
