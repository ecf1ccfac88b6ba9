"""The Anthropic Messages surface: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Requests become chat-template messages (system, tool_use -> ``tool_calls``, tool_result -> ``tool``
turns) and one :class:`GenerationRequest`; the answer is built from one event sequence, sent as
SSE when ``stream`` is true and folded into a single message otherwise.
"""

from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from .app import APIError, EventStream, GenerationRequest, Outcome, speculation_overrides, started
from .tools import ToolCall, ToolCallParser

log = logging.getLogger("mlxspec.server")
router = APIRouter()


class Block(BaseModel):
    """One content block; which fields matter depends on ``type``."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None


class CountBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict | None = None


class MessagesBody(CountBody):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict | None = None
    speculation: Any = None


# -- request -> chat-template messages -------------------------------------------------------

def _text_of(content, where: str) -> str:
    """A string, or the text blocks of a list joined by newlines (other blocks: 400)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for b in content:
        if b.type != "text":
            raise APIError(400, f"{where}: content block type '{b.type}' is not supported here; use text blocks")
        parts.append(b.text or "")
    return "\n".join(parts)


def template_messages(body: CountBody) -> list[dict]:
    if not body.messages:
        raise APIError(400, "messages: at least one message is required", param="messages")
    out: list[dict] = []
    system = _text_of(body.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for b in m.content:
            where = f"messages.{i}.content"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise APIError(400, f"{where}: tool_use blocks need a name", param=where)
                args = b.input if b.input is not None else {}
                if not isinstance(args, dict):
                    raise APIError(400, f"{where}: tool_use input must be an object", param=where)
                calls.append({"type": "function", "id": b.id,
                              "function": {"name": b.name, "arguments": args}})
            elif b.type == "tool_result" and m.role == "user":
                text = _text_of(b.content, where)
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": ("Error: " + text) if b.is_error else text})
            elif b.type in ("thinking", "redacted_thinking"):
                continue
            else:
                raise APIError(400, f"{where}: content block type '{b.type}' is not supported in "
                                    f"{m.role} messages by this server", param=where)
        out.extend(results)
        if texts or calls or not results:
            msg: dict = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def template_tools(body: CountBody) -> list[dict] | None:
    if not body.tools or (body.tool_choice or {}).get("type") == "none":
        return None
    tools = []
    for t in body.tools:
        if t.type not in (None, "custom"):
            raise APIError(400, f"tool type '{t.type}' (a server tool) is not supported here", param="tools")
        tools.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                       "parameters": t.input_schema}})
    return tools


def prompt_ids(server, body: CountBody) -> tuple[list[int], list[dict] | None]:
    """The prompt's token ids (a final assistant turn is a prefill: it continues that text)."""
    messages, tools = template_messages(body), template_tools(body)
    prefill = ""
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls") and len(messages) > 1:
        prefill = messages.pop()["content"].rstrip()  # Anthropic rejects trailing whitespace here
    ids = server.encode_chat(messages, tools)
    if prefill:
        tok = server.spec.tokenizer
        try:
            ids += list(tok.encode(prefill, add_special_tokens=False))
        except TypeError:
            ids += list(tok.encode(prefill))
    return ids, tools


# -- generation -> events --------------------------------------------------------------------

def _tool_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.split("_", 1)[-1], "name": call.name,
            "input": call.arguments}


async def content_events(deltas: AsyncIterator[str], parse_tools: bool) -> AsyncIterator[tuple[str, dict]]:
    """content_block_* events for a stream of text deltas (tool calls parsed when PARSE_TOOLS).

    With tools, whitespace just before or after tool calls (the template's newlines) is dropped."""
    parser = ToolCallParser() if parse_tools else None
    index, open_text, pending, calls = 0, False, "", 0

    def emit(piece: str):
        nonlocal open_text
        if not open_text:
            open_text = True
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {"type": "text", "text": ""}}
        yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                      "delta": {"type": "text_delta", "text": piece}}

    def text(piece: str):
        nonlocal pending
        if parser:  # hold trailing whitespace until we know no tool call follows it
            pending += piece
            body = pending.rstrip()
            if not body:
                return
            piece, pending = body, pending[len(body):]
        yield from emit(piece)

    def close_text():
        nonlocal open_text, index
        if open_text:
            open_text = False
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
            index += 1

    def call(c: ToolCall):
        nonlocal index, pending, calls
        pending, calls = "", calls + 1
        yield from close_text()
        block = _tool_block(c)
        yield "content_block_start", {"type": "content_block_start", "index": index,
                                      "content_block": {**block, "input": {}}}
        yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                      "delta": {"type": "input_json_delta", "partial_json": json.dumps(c.arguments)}}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
        index += 1

    def pieces(items):
        for p in items:
            yield from (call(p) if isinstance(p, ToolCall) else text(p))

    async with aclosing(deltas):
        async for delta in deltas:
            for event in pieces(parser.feed(delta) if parser else [delta]):
                yield event
    for event in pieces(parser.finish() if parser else []):
        yield event
    if pending and not calls:  # no tool call came after it: it is part of the answer
        for event in emit(pending):
            yield event
    for event in close_text():
        yield event


def stop_reason(outcome: Outcome, tool_calls: int) -> str:
    if tool_calls:
        return "tool_use"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if outcome.finish_reason == "length" else "end_turn"


def _sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


@router.post("/v1/messages")
async def messages(body: MessagesBody, request: Request):
    server = request.app.state.server
    server.check_model(body.model)
    server.check_max_tokens(body.max_tokens)
    drafter, depth = speculation_overrides(body.speculation, server.settings)
    ids, tools = prompt_ids(server, body)
    gen = GenerationRequest(prompt_ids=ids, max_tokens=body.max_tokens, temperature=body.temperature,
                            top_p=body.top_p if body.top_p is not None else 1.0, top_k=body.top_k or 0,
                            stop=[s for s in body.stop_sequences or [] if s], drafter=drafter, depth=depth)
    outcome = Outcome()
    message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
               "model": server.settings.model_name, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(ids), "output_tokens": 0}}
    events = content_events(server.generate(request, gen, outcome), parse_tools=bool(tools))

    def final_usage() -> dict:
        return {"input_tokens": len(ids), "output_tokens": outcome.completion_tokens,
                "speculation": outcome.speculation()}

    if not body.stream:
        blocks: list[dict] = []
        async for name, data in events:
            if name == "content_block_start":
                blocks.append(dict(data["content_block"]))
            elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
                blocks[-1]["text"] += data["delta"]["text"]
            elif name == "content_block_delta":
                blocks[-1]["input"] = json.loads(data["delta"]["partial_json"])
        n_calls = sum(b["type"] == "tool_use" for b in blocks)
        return {**message, "content": blocks, "stop_reason": stop_reason(outcome, n_calls),
                "stop_sequence": outcome.stop_sequence if not n_calls else None, "usage": final_usage()}

    chained = await started(events)  # errors before the first byte (queue full, bad drafter) stay HTTP errors

    async def stream():
        n_calls = 0
        async with aclosing(events):
            yield _sse("message_start", {"type": "message_start", "message": message})
            yield _sse("ping", {"type": "ping"})
            try:
                async for name, data in chained:
                    if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
                        n_calls += 1
                    yield _sse(name, data)
            except Exception as err:  # the response has started: report in-band
                if not isinstance(err, APIError):
                    log.exception("generation failed mid-stream")
                kind = getattr(err, "kind", "api_error")
                text = err.message if isinstance(err, APIError) else str(err) or "internal server error"
                yield _sse("error", {"type": "error", "error": {"type": kind, "message": text}})
                return
        reason = stop_reason(outcome, n_calls)
        yield _sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": reason,
                                               "stop_sequence": outcome.stop_sequence if not n_calls else None},
                                     "usage": final_usage()})
        yield _sse("message_stop", {"type": "message_stop"})

    return EventStream(stream())


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountBody, request: Request):
    server = request.app.state.server
    server.check_model(body.model)
    ids, _ = prompt_ids(server, body)
    return {"input_tokens": len(ids)}
