"""The ASGI app: one model, one worker, auth, limits, errors, health and metrics.

The OpenAI and Anthropic surfaces (``openai.py``, ``anthropic.py``) turn their requests into
:class:`GenerationRequest` s and stream :meth:`Server.generate`'s text deltas back.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import reasoning
from ..api import DRAFTERS
from ..errors import MlxspecError
from .worker import QueueFull, Worker

log = logging.getLogger("mlxspec.server")


class APIError(Exception):
    """A 4xx/5xx with a message; shaped per surface by the exception handler."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


@dataclass
class Settings:
    model_name: str
    api_key: str | None = None
    max_queue: int = 16
    max_tokens_cap: int = 4096
    max_body_bytes: int = 4 * 1024 * 1024
    drafter: str = "auto"
    depth: int | None = None
    cors: bool = False
    reasoning: str = "auto"  # on | off | auto: the chat template's enable_thinking by default


@dataclass
class GenerationRequest:
    """What every surface asks of the model."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    drafter: str = "auto"
    depth: int | None = None
    checkpoints: list[int] | None = None  # where a later turn may reuse the caches (prefix cache)


@dataclass
class Outcome:
    """Filled in as a generation runs."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length
    stop_sequence: str | None = None
    stats: object = None

    def speculation(self) -> dict:
        s = self.stats
        drafted = getattr(s, "drafted", 0)
        accepted = getattr(s, "accepted", 0)
        return {"drafter": getattr(s, "drafter", "none"), "drafted": drafted, "accepted": accepted,
                "acceptance": round(accepted / drafted, 4) if drafted else None}

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from the prefix cache instead of prefilled."""
        return getattr(self.stats, "cached_tokens", 0)


def speculation_overrides(body: dict | None, settings: Settings) -> tuple[str, int | None]:
    """The body's ``"speculation": {"drafter", "depth", "enabled"}`` over the server's defaults."""
    drafter, depth = settings.drafter, settings.depth
    if body is None:
        return drafter, depth
    if not isinstance(body, dict):
        raise APIError(400, "speculation must be an object", param="speculation")
    unknown = set(body) - {"drafter", "depth", "enabled"}
    if unknown:
        raise APIError(400, f"unknown speculation field(s): {', '.join(sorted(unknown))}", param="speculation")
    if "drafter" in body:
        if body["drafter"] not in DRAFTERS:
            raise APIError(400, f"speculation.drafter must be one of {', '.join(DRAFTERS)}",
                           param="speculation.drafter")
        drafter = body["drafter"]
    if "depth" in body:
        d = body["depth"]
        if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= 16:
            raise APIError(400, "speculation.depth must be an integer from 1 to 16", param="speculation.depth")
        depth = d
    if "enabled" in body:
        if not isinstance(body["enabled"], bool):
            raise APIError(400, "speculation.enabled must be true or false", param="speculation.enabled")
        if not body["enabled"]:
            drafter = "none"
    return drafter, depth


# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
_RESERVED = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
             "tokenize", "sanitize_control_tokens", "chat_template", "padding", "truncation", "max_length",
             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def template_overrides(settings: Settings, mode: str | None, extra) -> dict:
    """Chat-template variables: the server's --reasoning, over it the request's reasoning MODE
    (None: not given), over both its ``chat_template_kwargs``."""
    if extra is not None:
        if not isinstance(extra, dict):
            raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        taken = sorted(set(extra) & _RESERVED)
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)} (the server does)",
                           param="chat_template_kwargs")
    kwargs = reasoning.template_kwargs(mode if mode is not None else settings.reasoning)
    kwargs.update(extra or {})
    return kwargs


async def reasoning_pieces(deltas: AsyncIterator[str], in_reasoning: bool) -> AsyncIterator[tuple[str, str]]:
    """("reasoning" | "content", text) pieces of a generation's text deltas."""
    splitter = reasoning.ReasoningSplitter(in_reasoning)
    async with aclosing(deltas):  # closing the pieces stops the generation
        async for delta in deltas:
            for piece in splitter.feed(delta):
                yield piece
    for piece in splitter.finish():
        yield piece


def _stop_at(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits) if hits else None


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of TEXT that could begin a stop string (not sent yet)."""
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = max(keep, n)
                break
    return keep


class Metrics:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = self.drafted = self.accepted = 0
        self.cached_tokens = 0

    def observe(self, surface: str, status: int) -> None:
        self.requests[(surface, status)] = self.requests.get((surface, status), 0) + 1

    def render(self, queue_depth: int, prompt_cache=None) -> str:
        lines = ["# HELP mlxspec_requests_total Requests answered, by surface and HTTP status.",
                 "# TYPE mlxspec_requests_total counter"]
        for (surface, status), n in sorted(self.requests.items()):
            lines.append(f'mlxspec_requests_total{{surface="{surface}",status="{status}"}} {n}')
        for name, value, what in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens processed."),
            ("completion_tokens_total", self.completion_tokens, "Tokens generated."),
            ("drafted_tokens_total", self.drafted, "Draft tokens proposed to the target."),
            ("accepted_tokens_total", self.accepted, "Draft tokens the target accepted."),
            ("cached_prompt_tokens_total", self.cached_tokens, "Prompt tokens reused from the prefix cache."),
        ):
            lines += [f"# HELP mlxspec_{name} {what}", f"# TYPE mlxspec_{name} counter", f"mlxspec_{name} {value}"]
        rate = self.accepted / self.drafted if self.drafted else 0.0
        lines += ["# HELP mlxspec_acceptance_ratio Accepted over drafted tokens since start.",
                  "# TYPE mlxspec_acceptance_ratio gauge", f"mlxspec_acceptance_ratio {rate:.6f}",
                  "# HELP mlxspec_queue_depth Requests waiting or running.",
                  "# TYPE mlxspec_queue_depth gauge", f"mlxspec_queue_depth {queue_depth}"]
        if prompt_cache is not None:
            stats = prompt_cache.stats()
            lines += ["# HELP mlxspec_prompt_cache_bytes Bytes held by the prefix cache.",
                      "# TYPE mlxspec_prompt_cache_bytes gauge", f"mlxspec_prompt_cache_bytes {stats['bytes']}",
                      "# HELP mlxspec_prompt_cache_entries Cached prompt prefixes.",
                      "# TYPE mlxspec_prompt_cache_entries gauge",
                      f"mlxspec_prompt_cache_entries {stats['entries']}",
                      "# HELP mlxspec_prompt_cache_hits_total Requests that reused a cached prefix.",
                      "# TYPE mlxspec_prompt_cache_hits_total counter",
                      f"mlxspec_prompt_cache_hits_total {stats['hits']}"]
        return "\n".join(lines) + "\n"


class Server:
    def __init__(self, spec, settings: Settings):
        self.spec = spec
        self.settings = settings
        self.worker = Worker(spec, settings.max_queue)
        self.metrics = Metrics()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(404, f"model '{name}' is not served here; this server serves "
                                f"'{self.settings.model_name}'", kind="not_found_error", param="model")

    def check_max_tokens(self, n: int, param: str = "max_tokens") -> None:
        if n < 1:
            raise APIError(400, f"{param} must be at least 1", param=param)
        if n > self.settings.max_tokens_cap:
            raise APIError(400, f"{param} {n} is above this server's cap of {self.settings.max_tokens_cap}",
                           param=param)

    def encode_chat(self, messages: list[dict], tools: list | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        try:
            return self.spec.encode(messages, tools=tools, template_kwargs=template_kwargs)
        except Exception as err:  # jinja raises many types on odd messages
            raise APIError(400, f"the chat template rejected these messages: {' '.join(str(err).split())[:200]}")

    def reuse_points(self, messages: list[dict], prompt_ids: list[int], tools: list | None = None,
                     template_kwargs: dict | None = None) -> list[int]:
        """Where the next turn of this conversation will share the prompt (the prefix cache
        keeps a hybrid model's state there)."""
        points = getattr(self.spec, "reuse_points", None)  # (test doubles may have none)
        return points(messages, prompt_ids, tools=tools, template_kwargs=template_kwargs) if points else []

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        return reasoning.starts_in_reasoning(self.spec.tokenizer, prompt_ids)

    async def generate(self, request: Request, gen: GenerationRequest, outcome: Outcome) -> AsyncIterator[str]:
        """Text deltas of one generation; OUTCOME is complete when the iterator ends."""
        if not gen.prompt_ids:
            raise APIError(400, "the prompt is empty")
        kwargs = dict(prompt=gen.prompt_ids, max_tokens=gen.max_tokens, temperature=gen.temperature,
                      top_p=gen.top_p, top_k=gen.top_k, min_p=gen.min_p, seed=gen.seed,
                      drafter=gen.drafter, depth=gen.depth)
        if gen.checkpoints:
            kwargs["checkpoints"] = gen.checkpoints
        try:
            job = self.worker.submit(kwargs)
        except QueueFull:
            raise APIError(503, f"the server is busy ({self.settings.max_queue} requests queued); retry shortly",
                           kind="overloaded_error", headers={"Retry-After": "1"}) from None
        held, started = "", time.perf_counter()
        try:
            async for chunk in _request_errors(job.chunks()):
                if await request.is_disconnected():
                    return
                outcome.completion_tokens += len(chunk.tokens)
                outcome.stats = chunk.stats
                held += chunk.text
                hit = _stop_at(held, gen.stop)
                if hit is not None:
                    cut, outcome.stop_sequence = hit
                    outcome.finish_reason = "stop"
                    outcome.text += held[:cut]
                    if held[:cut]:
                        yield held[:cut]
                    held = ""
                    break
                safe = len(held) - _held_back(held, gen.stop)
                if safe > 0:
                    outcome.text += held[:safe]
                    yield held[:safe]
                    held = held[safe:]
            else:
                if held:
                    outcome.text += held
                    yield held
                outcome.finish_reason = getattr(outcome.stats, "finish_reason", None) or "stop"
        finally:
            job.cancel()
            self._account(gen, outcome, time.perf_counter() - started)

    def _account(self, gen: GenerationRequest, outcome: Outcome, seconds: float) -> None:
        m = self.metrics
        m.prompt_tokens += len(gen.prompt_ids)
        m.completion_tokens += outcome.completion_tokens
        spec = outcome.speculation()
        m.drafted += spec["drafted"]
        m.accepted += spec["accepted"]
        m.cached_tokens += outcome.cached_tokens
        log.info("prompt=%d cached=%d completion=%d finish=%s drafter=%s drafted=%d accepted=%d %.2fs",
                 len(gen.prompt_ids), outcome.cached_tokens, outcome.completion_tokens, outcome.finish_reason,
                 spec["drafter"],
                 spec["drafted"], spec["accepted"], seconds)


class EventStream(StreamingResponse):
    """An SSE response that closes its generator as soon as the response ends. A client that
    went away cancels the response while the generator waits at a ``yield``; without this the
    generation would run on until garbage collection got to it."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def started(items: AsyncIterator) -> AsyncIterator:
    """ITEMS with its first item awaited now: what fails before it (a full queue, a refused
    drafter) raises here, while the response can still be a plain HTTP error."""
    head = []
    try:
        head.append(await items.__anext__())
    except StopAsyncIteration:
        pass

    async def chained():
        for item in head:
            yield item
        async for item in items:
            yield item

    return chained()


async def _request_errors(chunks):
    """The engine refuses what the request asked for (e.g. drafter mtp on a model without a
    head) with an MlxspecError: that is the client's 400, on every surface."""
    try:
        async for chunk in chunks:
            yield chunk
    except MlxspecError as err:
        raise APIError(400, str(err)) from None


def _surface(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(surface: str, status: int, message: str, kind: str, param: str | None = None) -> dict:
    if surface == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
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
        surface = _surface(scope.get("path", ""))
        body = json.dumps(error_body(surface, 413, f"request body over {self.limit} bytes",
                                     "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def create_app(spec, settings: Settings) -> FastAPI:
    app = FastAPI(title="mlxspec", version=_version(),
                  description="OpenAI- and Anthropic-compatible API over one model, with exact speculative decoding.")
    server = Server(spec, settings)
    app.state.server = server
    open_paths = {"/health", "/docs", "/openapi.json", "/redoc"}

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        surface = _surface(request.url.path)
        if settings.api_key and request.url.path not in open_paths:
            given = request.headers.get("x-api-key") or ""
            bearer = request.headers.get("authorization") or ""
            if bearer.lower().startswith("bearer "):
                given = given or bearer[7:].strip()
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                server.metrics.observe(surface, 401)
                return JSONResponse(error_body(surface, 401, "invalid or missing API key "
                                               "(Authorization: Bearer KEY or x-api-key: KEY)",
                                               "authentication_error"), status_code=401)
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            server.metrics.observe(surface, response.status_code)
        return response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(error_body(_surface(request.url.path), err.status, err.message, err.kind, err.param),
                            status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            message, where = "the request body is not valid JSON", None
        else:
            message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(_surface(request.url.path), 400, message, "invalid_request_error", where),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        kind = _KINDS.get(err.status_code, "api_error")
        return JSONResponse(error_body(_surface(request.url.path), err.status_code, str(err.detail), kind),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(_surface(request.url.path), 500, "internal server error", "api_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_name, "queue_depth": server.worker.depth}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.worker.depth, getattr(spec, "prompt_cache", None)),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                            "created": 0, "owned_by": "mlxspec"}]}

    from . import anthropic, openai

    app.include_router(openai.router)
    app.include_router(anthropic.router)
    if settings.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app


def _version() -> str:
    from .. import __version__

    return __version__
