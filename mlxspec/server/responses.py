"""The OpenAI Responses surface: ``POST /v1/responses`` (and ``GET`` / ``DELETE`` of a kept one).

A body becomes chat-template messages and one :class:`~mlxspec.server.common.SurfaceRequest` on
the chat path (``responses_requests.py``), so at temperature 0 the text is chat completions'.
The answer is one sequence of Responses events (output items: reasoning, message, function_call),
sent as SSE when ``stream`` is true and folded into one response object otherwise. Answers with
``store`` (the default) are kept, a bounded few, for ``previous_response_id``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Request

from ..api import GenerationRequest
from ..errors import UsageError
from ..models.tokens import plain_ids
from ..options import MAX_STORED_RESPONSES
from .common import APIError, EventStream, Outcome, SurfaceRequest, speculation_overrides, started, template_overrides
from .contract import check_options
from .openai import reasoning_pieces
from .parsing import OffLoopRoute
from .responses_requests import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    check_body,
    constraint_of,
    input_messages,
    reasoning_mode,
)
from .structured import check_answer_start, reasoning_mode_for
from .tools import ToolCall, ToolCallParser

log = logging.getLogger("mlxspec.server")
router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop


class ResponseStore:
    """The last LIMIT stored responses: id -> (response object, the conversation's messages
    through it, instructions left out as OpenAI leaves them out of a continuation)."""

    def __init__(self, limit: int = MAX_STORED_RESPONSES):
        self.limit = limit
        self.kept: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, messages: list[dict]) -> None:
        self.kept[response["id"]] = (response, messages)
        self.kept.move_to_end(response["id"])
        while len(self.kept) > self.limit:
            self.kept.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if rid not in self.kept:
            raise APIError(404, f"response '{rid}' not found: this server keeps the last {self.limit} stored "
                                "responses, in memory", param=param)
        self.kept.move_to_end(rid)
        return self.kept[rid]

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self.kept[rid]


def store_of(request: Request) -> ResponseStore:
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


# -- generation -> output items and their events -------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Responses events for reasoning and answer pieces, one item open at a time: reasoning in
    reasoning items (reasoning_text), the answer in message items (output_text) and tool calls
    (when PARSE_TOOLS) in function_call items; ``items`` holds the finished ones. Each method
    yields event objects (no sequence_number). With tools, whitespace just before or after a
    call (the template's newlines) is dropped; with ONE_CALL the calls after the first are."""

    def __init__(self, parse_tools: bool, one_call: bool = False):
        self.parser = ToolCallParser() if parse_tools else None
        self.one_call = one_call
        self.items: list[dict] = []
        self.open: dict | None = None
        self.text = ""  # the open item's
        self.pending = ""  # whitespace held until it is known no tool call follows
        self.calls = 0

    def pieces(self, items):
        for kind, piece in items:
            if kind == "reasoning":
                yield from self.think(piece)
            else:
                for p in self.parser.feed(piece) if self.parser else [piece]:
                    yield from self.call(p) if isinstance(p, ToolCall) else self.answer(p)

    def finish(self):
        for p in self.parser.finish() if self.parser else []:
            yield from self.call(p) if isinstance(p, ToolCall) else self.answer(p)
        if self.pending and not self.calls:  # no call came after it: it is part of the answer
            yield from self.emit(self.pending)
        yield from self.close()

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}

    def _part(self, text: str) -> dict:
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def start(self, kind: str):
        if self.open is not None and self.open["type"] == kind:
            return
        yield from self.close()
        if kind == "reasoning":
            self.open = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []}
        else:
            self.open = {"type": "message", "id": _new_id("msg"), "role": "assistant", "content": []}
        self.text = ""
        yield {"type": "response.output_item.added", "output_index": len(self.items),
               "item": {**self.open, "status": "in_progress"}}
        yield {"type": "response.content_part.added", **self._where(), "part": self._part("")}

    def close(self):
        if self.open is None:
            return
        where, part = self._where(), self._part(self.text)
        if self.open["type"] == "reasoning":
            yield {"type": "response.reasoning_text.done", **where, "text": self.text}
        else:
            yield {"type": "response.output_text.done", **where, "text": self.text, "logprobs": []}
        yield {"type": "response.content_part.done", **where, "part": part}
        item = {**self.open, "content": [part], "status": "completed"}
        yield {"type": "response.output_item.done", "output_index": len(self.items), "item": item}
        self.items.append(item)
        self.open = None

    def think(self, piece: str):
        self.pending = ""  # whitespace between an answer and more reasoning: the template's
        yield from self.start("reasoning")
        self.text += piece
        yield {"type": "response.reasoning_text.delta", **self._where(), "delta": piece}

    def answer(self, piece: str):
        if self.parser:  # hold trailing whitespace until it is known no tool call follows
            self.pending += piece
            body = self.pending.rstrip()
            if not body:
                return
            piece, self.pending = body, self.pending[len(body):]
        yield from self.emit(piece)

    def emit(self, piece: str):
        yield from self.start("message")
        self.text += piece
        yield {"type": "response.output_text.delta", **self._where(), "delta": piece, "logprobs": []}

    def call(self, c: ToolCall):
        if self.one_call and self.calls:
            return
        self.pending, self.calls = "", self.calls + 1
        yield from self.close()
        args, index = json.dumps(c.arguments), len(self.items)
        item = {"type": "function_call", "id": _new_id("fc"), "call_id": c.id, "name": c.name, "arguments": args}
        yield {"type": "response.output_item.added", "output_index": index,
               "item": {**item, "arguments": "", "status": "in_progress"}}
        yield {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
               "delta": args}
        yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
               "name": c.name, "arguments": args}
        item["status"] = "completed"
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
        self.items.append(item)


async def output_events(deltas: AsyncIterator[str], items: OutputItems, in_reasoning: bool) -> AsyncIterator[dict]:
    """ITEMS' events for a generation's text deltas (IN_REASONING: it starts in the reasoning)."""
    pieces = reasoning_pieces(deltas, in_reasoning)
    async with aclosing(pieces):  # closing the events stops the generation
        async for kind, piece in pieces:
            for event in items.pieces([(kind, piece)]):
                yield event
    for event in items.finish():
        yield event


# -- the request ---------------------------------------------------------------------------------

def _usage(spec, gen: SurfaceRequest, outcome: Outcome, items: list[dict]) -> dict:
    """Responses' usage; reasoning_tokens: the reasoning's text tokenized again (the engine
    counts the answer's tokens, not where the reasoning ended)."""
    thought = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
    reasoning = len(plain_ids(spec.tokenizer, thought))
    n_in, n_out = len(gen.prompt_ids), outcome.completion_tokens
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": min(reasoning, n_out)},
            "total_tokens": n_in + n_out, "speculation": outcome.speculation()}


def _echo(body: ResponsesRequest, tools: list | None, model: str, max_tokens: int) -> dict:
    """The response's fields that echo the request."""
    fmt = (body.text.format if body.text is not None else None) or {"type": "text"}
    effort = body.reasoning.effort if body.reasoning is not None else None
    summary = (body.reasoning.summary or body.reasoning.generate_summary) if body.reasoning is not None else None
    return {"model": model, "instructions": body.instructions, "max_output_tokens": max_tokens,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "text": {"format": fmt},
            "reasoning": {"effort": effort, "summary": summary}, "store": body.store,
            "metadata": body.metadata or {}, "truncation": "disabled", "user": None}


async def _prompt(server, request: Request, body: ResponsesRequest):
    """(messages kept for a continuation, the SurfaceRequest, tools, whether it starts in reasoning)."""
    history = store_of(request).get(body.previous_response_id, "previous_response_id")[1] \
        if body.previous_response_id is not None else []
    conversation = history + input_messages(body.input)
    if not conversation:
        raise APIError(400, "input must not be empty", param="input")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    tools = chat_tools(body.tools)
    tools = tools if chat_tool_choice(body.tool_choice) != "none" else None
    constraint = constraint_of(body, tools)
    mode = reasoning_mode_for(reasoning_mode(body), constraint, "reasoning.effort")
    kwargs = template_overrides(server.settings, mode, None)
    prompt_ids, points, in_reasoning = await server.prompts.run(lambda: server.chat_prompt(messages, tools, kwargs))
    check_answer_start(constraint, in_reasoning, "text.format")
    sampling = {"temperature": body.temperature, "top_p": body.top_p}
    check_options("openai", sampling)
    max_tokens = body.max_output_tokens if body.max_output_tokens is not None \
        else min(server.settings.max_tokens_cap, 1024)
    server.check_max_tokens(max_tokens, "max_output_tokens")
    speculation = speculation_overrides(body.speculation, server.settings)
    try:
        generation = GenerationRequest(max_tokens=max_tokens, **sampling, **speculation, checkpoints=points,
                                       constraint=constraint)
    except UsageError as err:
        raise APIError(400, str(err)) from None
    return conversation, SurfaceRequest(prompt_ids=prompt_ids, generation=generation), tools, in_reasoning


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _stream_error(err: Exception) -> tuple[str, str]:
    """(code, message) of a failure after the stream began (logged unless an APIError)."""
    if isinstance(err, APIError):
        return err.kind, err.message
    log.exception("generation failed mid-stream")
    return "server_error", str(err) or "internal server error"


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    server = request.app.state.server
    server.check_model(body.model)
    check_body(body)
    conversation, gen, tools, in_reasoning = await _prompt(server, request, body)
    outcome, items = Outcome(), OutputItems(bool(tools), one_call=body.parallel_tool_calls is False)
    response = {"id": _new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "error": None, "incomplete_details": None, "output": [], "usage": None,
                **_echo(body, body.tools, server.settings.model_name, gen.generation.max_tokens)}
    events = output_events(server.generate(request, gen, outcome), items, in_reasoning)

    def finished() -> dict:
        incomplete = outcome.finish_reason == "length" and not items.calls
        out = {**response, "status": "incomplete" if incomplete else "completed", "output": items.items,
               "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
               "completed_at": None if incomplete else int(time.time()),
               "usage": _usage(server.spec, gen, outcome, items.items)}
        if body.store:
            store_of(request).put(out, conversation + input_messages(items.items))
        return out

    if not body.stream:
        async with aclosing(events):
            async for _ in events:
                pass
        return finished()

    chained = await started(events)  # errors before the first byte (queue full, bad drafter) stay HTTP errors

    async def stream():
        n = 0

        def numbered(event: dict) -> str:
            nonlocal n
            n += 1
            return _sse({**event, "sequence_number": n - 1})

        async with aclosing(events):
            yield numbered({"type": "response.created", "response": response})
            yield numbered({"type": "response.in_progress", "response": response})
            try:
                async for event in chained:
                    yield numbered(event)
            except Exception as err:  # the response has started: report in-band
                code, message = _stream_error(err)
                yield numbered({"type": "error", "code": code, "message": message, "param": None})
                yield numbered({"type": "response.failed", "response": {
                    **response, "status": "failed", "output": items.items,
                    "error": {"code": "server_error" if code == "server_error" else "invalid_prompt",
                              "message": message}}})
                return
        final = finished()
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield numbered({"type": kind, "response": final})

    return EventStream(stream())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return store_of(request).get(response_id, "response_id")[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    store_of(request).delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
