"""The Anthropic Messages surface: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Requests become chat-template messages (system, tool_use -> ``tool_calls``, tool_result -> ``tool``
turns) and one :class:`~mlxspec.server.common.SurfaceRequest`; the answer is built from one event
sequence, sent as SSE when ``stream`` is true and folded into a single message otherwise.
"""

from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ..api import GenerationRequest
from ..errors import UsageError
from ..models.tokens import plain_ids
from ..options import ConstraintSpec
from ..reasoning import ReasoningSplitter
from .common import (
    APIError,
    EventStream,
    Outcome,
    SurfaceRequest,
    speculation_overrides,
    started,
    template_overrides,
)
from .contract import RequestBody, check_options, check_stop_strings, limit_text
from .parsing import OffLoopRoute
from .structured import check_answer_start, forced_tool_constraint, reasoning_mode_for
from .tools import ToolCall, ToolCallParser

log = logging.getLogger("mlxspec.server")
router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop


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


class ToolChoice(RequestBody):
    """auto: the model decides; any: one call of some tool; tool: one call of NAME; none: no tools."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # true: at most one tool call comes back


class CountBody(RequestBody):
    """What /v1/messages/count_tokens takes: the prompt's part of a /v1/messages body."""

    # the rest of a /v1/messages body shapes the answer, not the prompt: a client may count the
    # body it is about to send
    IGNORED = dict.fromkeys(("max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream", "metadata",
                             "service_tier", "speculation"), "generation, not prompt")
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Any = None  # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"} | {"type": "adaptive"}
    chat_template_kwargs: Any = None


class MessagesBody(CountBody):
    # Anthropic fields a client may send that change nothing in what is generated here
    IGNORED = {
        "metadata": "a user_id for Anthropic's abuse monitoring: nothing is monitored here",
        "service_tier": "Anthropic's capacity tier: there is one here",
    }
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, description=limit_text("temperature", "anthropic"))
    top_p: float | None = Field(None, description=limit_text("top_p", "anthropic"))
    top_k: int | None = Field(None, description=limit_text("top_k", "anthropic"))
    stream: bool = False
    speculation: Any = None


# -- request -> chat-template messages -------------------------------------------------------

def _block_text(block: Block, where: str) -> str:
    """A text block's text; one without it is a 400 (as Anthropic's), not an empty turn."""
    if block.text is None:
        raise APIError(400, f"{where}: a text block needs its text", param=where)
    return block.text


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
        parts.append(_block_text(b, where))
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
        texts, calls, results, thoughts = [], [], [], []
        for b in m.content:
            where = f"messages.{i}.content"
            if b.type == "text":
                texts.append(_block_text(b, where))
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
            elif b.type == "thinking" and m.role == "assistant":
                thought = (b.model_extra or {}).get("thinking")
                if thought is not None and not isinstance(thought, str):
                    raise APIError(400, f"{where}: a thinking block's thinking must be a string", param=where)
                thoughts.append(thought or "")
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
            if any(thoughts):  # templates render it where the model should see it (after tool calls)
                msg["reasoning_content"] = "\n".join(t for t in thoughts if t)
            out.append(msg)
    return out


def template_tools(body: CountBody) -> list[dict] | None:
    if not body.tools or (body.tool_choice is not None and body.tool_choice.type == "none"):
        return None
    tools = []
    for i, t in enumerate(body.tools):
        if t.type not in (None, "custom"):
            raise APIError(400, f"tool type '{t.type}' (a server tool) is not supported here", param="tools")
        if not t.name.strip():  # a template would offer a tool no call can name
            raise APIError(400, f"tools.{i}.name must not be empty", param=f"tools.{i}.name")
        tools.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                       "parameters": t.input_schema}})
    return tools


THINKING_TYPES = {"enabled": "on", "disabled": "off", "adaptive": "auto"}


def thinking_mode(thinking) -> tuple[str | None, bool]:
    """(on / off / auto or None when not given, whether the thinking is to be left out)."""
    if thinking is None:
        return None, False
    if not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str) \
            or thinking["type"] not in THINKING_TYPES:
        raise APIError(400, "thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                            "{\"type\": \"disabled\"} or {\"type\": \"adaptive\"}", param="thinking")
    unknown = set(thinking) - {"type", "budget_tokens", "display"}
    if unknown:
        raise APIError(400, f"unknown thinking field(s): {', '.join(sorted(unknown))}", param="thinking")
    budget = thinking.get("budget_tokens")  # accepted, not enforced: the model ends its own reasoning
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise APIError(400, "thinking.budget_tokens must be a positive integer", param="thinking.budget_tokens")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise APIError(400, "thinking.display must be summarized or omitted", param="thinking.display")
    return THINKING_TYPES[thinking["type"]], display == "omitted"


def tool_constraint(body: CountBody, tools: list[dict] | None) -> ConstraintSpec | None:
    """The constraint of a ``tool_choice`` that forces a call (any: of some tool; tool: of the
    named one); None when it forces none."""
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return None
    if not tools:
        raise APIError(400, f"tool_choice {choice.type} needs tools", param="tool_choice")
    if choice.type == "tool" and not choice.name:
        raise APIError(400, "tool_choice tool needs the tool's name", param="tool_choice.name")
    forced = "required" if choice.type == "any" else {"type": "function", "function": {"name": choice.name}}
    return forced_tool_constraint(tools, forced)


@dataclass
class Prompt:
    """A body's prompt as the model sees it: one rendering serves /v1/messages and count_tokens,
    so their counts agree."""

    ids: list[int]
    tools: list[dict] | None  # as the chat template got them
    constraint: ConstraintSpec | None  # a forced tool call's
    points: list[int]  # where a later turn may reuse the prefix cache
    in_reasoning: bool  # the answer starts inside the reasoning


def rendered(server, body: CountBody) -> Prompt:
    """BODY's prompt (blocking: run it through ``server.prompts``); a final assistant turn is
    a prefill: the answer continues that text."""
    messages, tools = template_messages(body), template_tools(body)
    constraint = tool_constraint(body, tools)
    mode = reasoning_mode_for(thinking_mode(body.thinking)[0], constraint, "thinking")
    kwargs = template_overrides(server.settings, mode, body.chat_template_kwargs)
    server.prompts.check_size(messages, tools)  # the prefill too, before it is taken off
    prefill = ""
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls") and len(messages) > 1:
        prefill = messages.pop()["content"].rstrip()  # Anthropic rejects trailing whitespace here
    ids = server.encode_chat(messages, tools, kwargs)
    points = server.reuse_points(messages, ids, tools, kwargs)
    ids += plain_ids(server.spec.tokenizer, prefill)
    in_reasoning = server.starts_in_reasoning(ids)
    check_answer_start(constraint, in_reasoning, "tool_choice")
    return Prompt(ids, tools, constraint, points, in_reasoning)


# -- generation -> events --------------------------------------------------------------------

def _tool_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.split("_", 1)[-1], "name": call.name,
            "input": call.arguments}


class ContentBlocks:
    """content_block_* events for reasoning and answer pieces, one block open at a time:
    reasoning in thinking blocks (empty unless SHOW_THINKING), the answer in text blocks, and
    tool calls (when PARSE_TOOLS) in tool_use blocks. Each method yields (name, data) events.

    With tools, whitespace just before or after tool calls (the template's newlines) is dropped;
    with ONE_CALL, the calls after the first are left out."""

    def __init__(self, parse_tools: bool, show_thinking: bool = True, one_call: bool = False):
        self.parser = ToolCallParser() if parse_tools else None
        self.show_thinking, self.one_call = show_thinking, one_call
        self.index = 0  # of the block open or next
        self.open_block: str | None = None  # "text" | "thinking" | None
        self.pending = ""  # whitespace held back until it is known no tool call follows
        self.calls = 0

    def pieces(self, items):
        """Events for ReasoningSplitter's ("reasoning" | "content", text) pieces."""
        for kind, piece in items:
            if kind == "reasoning":
                yield from self.think(piece)
            else:
                yield from self.answer(self.parser.feed(piece) if self.parser else [piece])

    def finish(self):
        """Events once the text has ended: what the tool parser held, then the last block's end."""
        yield from self.answer(self.parser.finish() if self.parser else [])
        if self.pending and not self.calls:  # no tool call came after it: it is part of the answer
            yield from self.emit(self.pending)
        yield from self.close()

    def answer(self, items):
        for p in items:
            yield from (self.call(p) if isinstance(p, ToolCall) else self.text(p))

    def close(self):
        if self.open_block == "thinking":  # clients wait for it; there is nothing to sign here
            yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": {"type": "signature_delta", "signature": ""}}
        if self.open_block:
            self.open_block = None
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
            self.index += 1

    def start(self, kind: str):
        if self.open_block != kind:
            yield from self.close()
            self.open_block = kind
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                          "content_block": block}

    def emit(self, piece: str):
        yield from self.start("text")
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "text_delta", "text": piece}}

    def think(self, piece: str):
        self.pending = ""  # whitespace between an answer and more reasoning: the template's
        yield from self.start("thinking")
        if self.show_thinking:  # display "omitted": the block is there, its text is not
            yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": {"type": "thinking_delta", "thinking": piece}}

    def text(self, piece: str):
        if self.parser:  # hold trailing whitespace until we know no tool call follows it
            self.pending += piece
            body = self.pending.rstrip()
            if not body:
                return
            piece, self.pending = body, self.pending[len(body):]
        yield from self.emit(piece)

    def call(self, c: ToolCall):
        if self.one_call and self.calls:
            return
        self.pending, self.calls = "", self.calls + 1
        yield from self.close()
        block = _tool_block(c)
        yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                      "content_block": {**block, "input": {}}}
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "input_json_delta", "partial_json": json.dumps(c.arguments)}}
        yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
        self.index += 1


async def content_events(deltas: AsyncIterator[str], parse_tools: bool, in_reasoning: bool = False,
                         show_thinking: bool = True, one_call: bool = False) -> AsyncIterator[tuple[str, dict]]:
    """content_block_* events for a stream of text deltas (see :class:`ContentBlocks`).
    IN_REASONING: the text starts inside the reasoning."""
    blocks = ContentBlocks(parse_tools, show_thinking, one_call)
    splitter = ReasoningSplitter(in_reasoning)
    async with aclosing(deltas):
        async for delta in deltas:
            for event in blocks.pieces(splitter.feed(delta)):
                yield event
    for event in blocks.pieces(splitter.finish()):
        yield event
    for event in blocks.finish():
        yield event


async def folded_blocks(events: AsyncIterator[tuple[str, dict]]) -> list[dict]:
    """The content blocks that content_block_* EVENTS describe, each complete."""
    blocks: list[dict] = []
    async for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[-1]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                blocks[-1]["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                blocks[-1]["signature"] = delta["signature"]
            else:
                blocks[-1]["input"] = json.loads(delta["partial_json"])
    return blocks


def stop_reason(outcome: Outcome, tool_calls: int) -> str:
    if tool_calls:
        return "tool_use"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if outcome.finish_reason == "length" else "end_turn"


def stream_error(err: Exception) -> dict:
    """The error object for a failure after the stream has started (logged unless an APIError)."""
    if isinstance(err, APIError):
        return {"type": err.kind, "message": err.message}
    log.exception("generation failed mid-stream")
    return {"type": "api_error", "message": str(err) or "internal server error"}


def _sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


@router.post("/v1/messages")
async def messages(body: MessagesBody, request: Request):
    server = request.app.state.server
    server.check_model(body.model)
    server.check_max_tokens(body.max_tokens)
    sampling = {"temperature": body.temperature, "top_p": body.top_p if body.top_p is not None else 1.0,
                "top_k": body.top_k or 0}
    check_options("anthropic", sampling)
    check_stop_strings(body.stop_sequences or [], "stop_sequences")
    speculation = speculation_overrides(body.speculation, server.settings)
    _, omit_thinking = thinking_mode(body.thinking)
    prompt = await server.prompts.run(rendered, server, body)
    ids, tools = prompt.ids, prompt.tools
    try:
        generation = GenerationRequest(max_tokens=body.max_tokens, **sampling, **speculation,
                                       checkpoints=prompt.points, constraint=prompt.constraint)
    except UsageError as err:
        raise APIError(400, str(err)) from None
    gen = SurfaceRequest(prompt_ids=ids, generation=generation, stop=[s for s in body.stop_sequences or [] if s])
    one_call = bool(body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    outcome = Outcome()
    message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
               "model": server.settings.model_name, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(ids), "output_tokens": 0}}
    events = content_events(server.generate(request, gen, outcome), parse_tools=bool(tools),
                            in_reasoning=prompt.in_reasoning, show_thinking=not omit_thinking, one_call=one_call)

    def final_usage() -> dict:
        return {"input_tokens": len(ids), "output_tokens": outcome.completion_tokens,
                "cache_read_input_tokens": outcome.cached_tokens, "speculation": outcome.speculation()}

    if not body.stream:
        blocks = await folded_blocks(events)
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
                yield _sse("error", {"type": "error", "error": stream_error(err)})
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
    prompt = await server.prompts.run(rendered, server, body)
    return {"input_tokens": len(prompt.ids)}
