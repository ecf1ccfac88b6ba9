"""What the server's modules share: settings, the model they serve, requests and outcomes of a
generation, errors and how each surface shapes them, and SSE response helpers.

The OpenAI and Anthropic surfaces turn their requests into :class:`SurfaceRequest` s and
stream the generation's text deltas back; nothing here knows either surface's request format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Protocol

from fastapi.responses import StreamingResponse

from .. import reasoning
from ..api import Chunk, GenerationRequest
from ..engine.stats import Stats
from ..options import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS_CAP,
    DRAFTERS,
    MAX_DEPTH,
    MAX_TREE,
    MIN_DEPTH,
)

if TYPE_CHECKING:
    from ..engine.prefix_cache import PrefixCache


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
    max_queue: int = DEFAULT_MAX_QUEUE  # requests that may wait while one generates (0: none)
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drafter: str = "auto"
    depth: int | None = None
    cors: bool = False
    reasoning: str = "auto"  # on | off | auto: the chat template's enable_thinking by default
    prompt_workers: int = 2  # prompts rendered and tokenized at once (max_queue more may wait)
    ui: bool = True  # the chat page at / and /ui/ (ui.py); serve turns it off off loopback
    max_batch: int = 1  # requests decoded together (worker.py); 1: one at a time


class ServedModel(Protocol):
    """What the server needs of the loaded model: a :class:`~mlxspec.api.SpecModel`, or a
    test's stand-in for one."""

    tokenizer: Any
    target: Any  # its vocab_size bounds prompts given as token ids
    prompt_cache: PrefixCache

    def encode(self, prompt, *, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> list[int]: ...

    def reuse_points(self, prompt, prompt_ids: list[int], *, tools: list[dict] | None = None,
                     template_kwargs: dict | None = None) -> list[int]: ...

    def stream(self, prompt, request: GenerationRequest | None = None, **options) -> Iterator[Chunk]: ...


@dataclass(frozen=True)
class SurfaceRequest:
    """What a surface asks of the model: the prompt's token ids, how to generate (sampling,
    speculation, where a later turn may reuse the caches: handed to ``SpecModel.stream`` as
    is) and the stop strings the server cuts the text at."""

    prompt_ids: list[int]
    generation: GenerationRequest
    stop: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    """Filled in as a generation runs."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length (and in the log: cancelled | error)
    stop_sequence: str | None = None
    stats: Stats = field(default_factory=Stats)  # the latest chunk's; empty before the first
    # with logprobs requested: one per answer token so far (end-of-text tokens left out); a
    # surface streaming them sends those past what it sent with its last delta
    logprobs: list | None = None
    # character spans [start, end) of text that came from accepted draft tokens (may reach past
    # text: what a stop string cut off)
    drafted_spans: list[tuple[int, int]] = field(default_factory=list)

    def add_drafted(self, start: int, end: int) -> None:
        if end <= start:
            return
        if self.drafted_spans and self.drafted_spans[-1][1] == start:
            start = self.drafted_spans.pop()[0]
        self.drafted_spans.append((start, end))

    def drafted_within(self, start: int, end: int) -> list[list[int]]:
        """The drafted spans inside text[start:end], relative to START."""
        out = []
        for a, b in reversed(self.drafted_spans):  # the latest first: deltas are the text's end
            if b <= start:
                break
            if a < end:
                out.append([max(a, start) - start, min(b, end) - start])
        return out[::-1]

    def speculation(self) -> dict:
        s = self.stats
        return {"drafter": s.drafter, "drafted": s.drafted, "accepted": s.accepted, "tree_steps": s.tree_steps,
                "acceptance": round(s.accepted / s.drafted, 4) if s.drafted else None}

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from the prefix cache instead of prefilled."""
        return self.stats.cached_tokens


class DraftMarks:
    """Where a stream's text pieces (the reasoning and answer pieces of OUTCOME's text, tags
    and the newlines around them left out) lie in that text, and which of their characters came
    from accepted draft tokens: the stream's ``x_mlxspec`` extension."""

    def __init__(self, outcome: Outcome):
        self.outcome, self.at = outcome, 0

    def locate(self, piece: str) -> int | None:
        text, at = self.outcome.text, self.at
        while at < len(text) and not text.startswith(piece, at):
            tag = next((t for t in (reasoning.OPEN, reasoning.CLOSE) if text.startswith(t, at)), None)
            if tag is None and text[at] != "\n":
                break
            at += len(tag) if tag else 1  # what the reasoning splitter leaves out
        if text.startswith(piece, at):
            return at
        found = text.find(piece, at)  # past what the tool call parser took
        return found if found >= 0 else None

    def of(self, piece: str) -> dict:
        """The extension for the chunk carrying PIECE: "drafted", the character spans of PIECE
        (relative to it) that came from accepted draft tokens, and the running counts so far."""
        at, o = self.locate(piece), self.outcome
        spans = []
        if at is not None:
            self.at = at + len(piece)
            spans = o.drafted_within(at, at + len(piece))
        return {"drafted": spans, "completion_tokens": o.completion_tokens,
                "draft_tokens": o.stats.drafted, "accepted_tokens": o.stats.accepted}


def speculation_overrides(body: dict | None, settings: Settings) -> dict:
    """The body's ``"speculation": {"drafter", "depth", "tree", "enabled"}`` over the server's
    defaults, as GenerationRequest keyword arguments (drafter, depth, tree)."""
    out = {"drafter": settings.drafter, "depth": settings.depth, "tree": "default"}
    if body is None:
        return out
    if not isinstance(body, dict):
        raise APIError(400, "speculation must be an object", param="speculation")
    unknown = set(body) - {"drafter", "depth", "tree", "enabled"}
    if unknown:
        raise APIError(400, f"unknown speculation field(s): {', '.join(sorted(unknown))}", param="speculation")
    if "drafter" in body:
        if body["drafter"] not in DRAFTERS:
            raise APIError(400, f"speculation.drafter must be one of {', '.join(DRAFTERS)}",
                           param="speculation.drafter")
        out["drafter"] = body["drafter"]
    if "depth" in body:
        d = body["depth"]
        if not isinstance(d, int) or isinstance(d, bool) or not MIN_DEPTH <= d <= MAX_DEPTH:
            raise APIError(400, f"speculation.depth must be an integer from {MIN_DEPTH} to {MAX_DEPTH}",
                           param="speculation.depth")
        out["depth"] = d
    if "tree" in body:
        t = body["tree"]
        if t == "auto":
            t = None
        elif not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TREE:
            raise APIError(400, f'speculation.tree must be "auto" or a node count from 0 to {MAX_TREE}',
                           param="speculation.tree")
        out["tree"] = t
    if "enabled" in body:
        if not isinstance(body["enabled"], bool):
            raise APIError(400, "speculation.enabled must be true or false", param="speculation.enabled")
        if not body["enabled"]:
            out["drafter"] = "none"
    return out


# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "tokenize", "sanitize_control_tokens", "chat_template", "padding",
                      "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                      "tokenizer_kwargs"}


def template_overrides(settings: Settings, mode: str | None, extra) -> dict:
    """Chat-template variables: the server's --reasoning, over it the request's reasoning MODE
    (None: not given), over both its ``chat_template_kwargs``."""
    if extra is not None:
        if not isinstance(extra, dict):
            raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        taken = sorted(set(extra) & TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)} (the server does)",
                           param="chat_template_kwargs")
    kwargs = reasoning.template_kwargs(mode if mode is not None else settings.reasoning)
    kwargs.update(extra or {})
    return kwargs


def surface_of(path: str) -> str:
    """Which API surface a request path belongs to: errors are shaped the way it expects."""
    if path.startswith("/api/"):
        return "ollama"
    return "anthropic" if path.startswith("/v1/messages") else "openai"


# what an error message may not carry as is: line breaks and other control characters (a message
# is one line), lone surrogates (no response can encode them)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f\u2028\u2029\ud800-\udfff]")


def one_line(text: str) -> str:
    """TEXT with what echoes a request into it (a block type, a model name, a key) made safe for
    an error message: control characters and lone surrogates as their escapes (\\n, \\ud800)."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def error_body(surface: str, status: int, message: str, kind: str, param: str | None = None) -> dict:
    message = one_line(message)
    param = one_line(param) if isinstance(param, str) else param
    if surface == "ollama":
        return {"error": message}
    if surface == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class EventStream(StreamingResponse):
    """An SSE response (or another streamed MEDIA_TYPE: Ollama's NDJSON) that closes its
    generator as soon as the response ends. A client that went away cancels the response while
    the generator waits at a ``yield``; without this the generation would run on until garbage
    collection got to it."""

    def __init__(self, content, media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type,
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
