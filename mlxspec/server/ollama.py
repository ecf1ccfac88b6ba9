"""The Ollama surface: ``/api/chat``, ``/api/generate`` (NDJSON streams by default, one object
with ``"stream": false``), ``/api/tags``, ``/api/show``, ``/api/ps`` and ``/api/version``.

Requests become the same :class:`~mlxspec.server.common.SurfaceRequest` the other surfaces
build (so the text at temperature 0 is theirs); ``options`` maps onto the sampling options and
penalties (``ollama_options.py`` says which are read, which are accepted with no effect, and
answers a 400 for the rest, as for any other field a body may not carry), ``think`` onto the
reasoning switch, ``format`` onto constrained output, ``logprobs`` / ``top_logprobs`` onto the
engine's log-probabilities (Ollama renders them as OpenAI's chat does). Errors are
``{"error": "..."}``.
What the model listing endpoints say about the model is in ``ollama_models.py``.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from .. import __version__
from ..api import GenerationRequest
from ..errors import UsageError
from ..options import ConstraintSpec
from ..reasoning import ReasoningSplitter
from . import fim
from .chat_messages import CHAT_ROLES, function_tools, message_role
from .common import APIError, EventStream, Outcome, SurfaceRequest, speculation_overrides, started, template_overrides
from .contract import RequestBody
from .json_limits import check_json_text
from .ollama_models import model_details, now_rfc3339, running_model, show_model
from .ollama_options import sampling
from .parsing import OffLoopRoute
from .structured import LogprobRenderer, chat_logprobs, check_answer_start, reasoning_mode_for
from .tools import ToolCall, ToolCallParser

router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop

# the Ollama API version this surface answers as: clients gate features on it (tools need
# 0.3, think 0.9), all of which are served here
OLLAMA_VERSION = "0.12.0"

NDJSON = "application/x-ndjson"


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list | None = None
    tool_calls: list[dict] | None = None
    tool_name: str | None = None


class _Body(RequestBody):
    model: str | None = None
    format: Any = None
    options: Any = None
    stream: bool = True  # Ollama streams unless told not to
    think: bool | str | None = None
    keep_alive: Any = None  # read by a request with nothing to generate (its reply); the model stays loaded
    logprobs: Any = None
    top_logprobs: Any = None
    speculation: Any = None


class ChatBody(_Body):
    messages: list[Message] | None = None
    tools: list[dict] | None = None


class GenerateBody(_Body):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list | None = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool = False


# -- request -> generation --------------------------------------------------------------------

def served_name(server, name: str | None) -> str:
    """The served model's name when NAME is it (``:latest``, the tag Ollama adds, allowed); else
    400 (none given) or 404, as Ollama answers."""
    if not name:
        raise APIError(400, "model is required", param="model")
    if name.endswith(":latest"):
        name = name[: -len(":latest")]
    if name != server.settings.model_name:
        raise APIError(404, f"model '{name}' not found; this server serves '{server.settings.model_name}'",
                       kind="not_found_error", param="model")
    return server.settings.model_name


def constraint(fmt) -> ConstraintSpec | None:
    """``format``: "json" (any JSON value's object) or a JSON schema, as constrained output."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ConstraintSpec("json")
    if isinstance(fmt, dict):
        return ConstraintSpec("json_schema", fmt)
    raise APIError(400, 'format must be "json" or a JSON schema object', param="format")


THINK_LEVELS = ("low", "medium", "high")  # gpt-oss's levels: here, thinking on


def think_mode(think) -> str | None:
    """The reasoning mode ``think`` asks for; None: not given (the server's default)."""
    if think is None:
        return None
    if isinstance(think, bool):
        return "on" if think else "off"
    if think in THINK_LEVELS:
        return "on"
    raise APIError(400, f"think must be true, false or one of {', '.join(THINK_LEVELS)}", param="think")


def surface_request(server, body: _Body, prompt_ids: list[int], checkpoints: list[int] | None,
                    fmt: ConstraintSpec | None) -> SurfaceRequest:
    """How to generate for BODY; FMT: its ``format`` as a constraint (see :func:`constraint`)."""
    values, stop = sampling(server, body.options)
    speculation = speculation_overrides(body.speculation, server.settings)
    try:
        generation = GenerationRequest(**values, **speculation, checkpoints=checkpoints,
                                       constraint=fmt,
                                       logprobs=chat_logprobs(body.logprobs, body.top_logprobs))
    except UsageError as err:
        raise APIError(400, str(err)) from None
    return SurfaceRequest(prompt_ids=prompt_ids, generation=generation, stop=stop)


def _tool_call(call: dict, where: str) -> dict:
    """A past tool call (``{"function": {"name", "arguments": {...}}}``) as templates want it."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where}.function must be an object with a string name", param=where)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        check_json_text(args, f"{where}.function.arguments")
        try:
            args = json.loads(args)
        except ValueError:  # not JSON, or an integer past Python's 4,300 digits
            raise APIError(400, f"{where}.function.arguments is not valid JSON", param=where) from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be an object", param=where)
    return {"type": "function", "id": call.get("id"), "function": {"name": fn["name"], "arguments": args}}


def template_messages(messages: list[Message]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(400, f"messages.{i}.images: images are not supported by this server (text models only)",
                           param=f"messages.{i}.images")
        role = message_role(m.role, CHAT_ROLES, f"messages.{i}.role")
        msg: dict[str, Any] = {"role": role, "content": m.content or ""}
        if role == "assistant" and m.thinking:
            msg["reasoning_content"] = m.thinking  # templates render it where the model should see it
        if m.tool_calls:
            msg["tool_calls"] = [_tool_call(c, f"messages.{i}.tool_calls.{k}") for k, c in enumerate(m.tool_calls)]
        if m.tool_name:
            msg["name"] = m.tool_name
        out.append(msg)
    return out


# -- generation -> Ollama objects -------------------------------------------------------------

async def reply_parts(deltas: AsyncIterator[str], in_reasoning: bool | None,
                      parse_tools: bool) -> AsyncIterator[tuple[str, Any]]:
    """("thinking" | "content", text) and ("tool_call", ToolCall) parts of a generation's text;
    IN_REASONING None: raw text, no reasoning split."""
    splitter = ReasoningSplitter(in_reasoning) if in_reasoning is not None else None
    parser = ToolCallParser() if parse_tools else None

    def parts(pieces):
        for kind, text in pieces:
            if kind == "reasoning":
                yield "thinking", text
                continue
            for p in (parser.feed(text) if parser else [text]):
                yield ("tool_call", p) if isinstance(p, ToolCall) else ("content", p)

    async with aclosing(deltas):  # closing the parts stops the generation
        async for delta in deltas:
            for part in parts(splitter.feed(delta) if splitter else [("content", delta)]):
                yield part
    for part in parts(splitter.finish() if splitter else []):
        yield part
    for p in parser.finish() if parser else []:
        yield "content", p


def call_json(call: ToolCall, index: int) -> dict:
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": call.arguments}}


def final_fields(gen: SurfaceRequest, outcome: Outcome, began: float) -> dict:
    """The last object's counts and durations (nanoseconds); the model is loaded already."""
    s = outcome.stats
    return {"done": True, "done_reason": "length" if outcome.finish_reason == "length" else "stop",
            "total_duration": int((time.perf_counter() - began) * 1e9), "load_duration": 0,
            "prompt_eval_count": len(gen.prompt_ids), "prompt_eval_duration": int(s.prompt_time_s * 1e9),
            "eval_count": outcome.completion_tokens, "eval_duration": int(s.decode_time_s * 1e9),
            "speculation": outcome.speculation()}


def _line(obj: dict) -> str:
    return json.dumps(obj) + "\n"


def loaded(model: str, body: _Body, chat: bool) -> dict:
    """Ollama's answer to a request with nothing to generate: it loads (or unloads) the model."""
    reply = {"model": model, "created_at": now_rfc3339(), "done": True,
             "done_reason": "unload" if body.keep_alive in (0, "0") else "load"}
    return {**reply, "message": {"role": "assistant", "content": ""}} if chat else {**reply, "response": ""}


async def answer(request: Request, body: _Body, gen: SurfaceRequest, in_reasoning: bool | None,
                 parse_tools: bool, chat: bool, began: float):
    """The reply: one object folded from the parts, or an NDJSON stream of them."""
    server = request.app.state.server
    outcome = Outcome()
    head = {"model": server.settings.model_name}
    parts = reply_parts(server.generate(request, gen, outcome), in_reasoning, parse_tools)
    render = LogprobRenderer(server.spec).chat if gen.generation.logprobs is not None else None
    sent = 0

    def with_logprobs(obj: dict) -> dict:
        """OBJ with the log-probabilities of the tokens generated since the last object."""
        nonlocal sent
        if render is None:
            return obj
        items = (outcome.logprobs or [])[sent:]
        sent += len(items)
        return {**obj, "logprobs": render(items)}

    def shaped(fields: dict) -> dict:
        """FIELDS (content, thinking, tool_calls) where this endpoint puts them."""
        if chat:
            return {**head, "created_at": now_rfc3339(), "message": {"role": "assistant", "content": "", **fields}}
        fields = {("response" if k == "content" else k): v for k, v in fields.items()}
        return {**head, "created_at": now_rfc3339(), "response": "", **fields}

    if not body.stream:
        text, thought, calls = "", "", []
        async for kind, value in parts:
            if kind == "tool_call":
                calls.append(call_json(value, len(calls)))
            elif kind == "thinking":
                thought += value
            else:
                text += value
        fields: dict[str, Any] = {"content": text}
        if thought:
            fields["thinking"] = thought
        if calls:
            fields["tool_calls"] = calls
        return with_logprobs({**shaped(fields), **final_fields(gen, outcome, began)})

    parts = await started(parts)  # errors before the first byte are still plain HTTP errors

    async def lines():
        n_calls = 0
        try:
            async for kind, value in parts:
                if kind == "tool_call":
                    fields = {"tool_calls": [call_json(value, n_calls)]}
                    n_calls += 1
                else:
                    fields = {kind: value}
                yield _line(with_logprobs({**shaped(fields), "done": False}))
        except APIError as err:  # the response has started: report in-band, as Ollama does
            yield _line({"error": err.message})
            return
        yield _line(with_logprobs({**shaped({}), **final_fields(gen, outcome, began)}))

    return EventStream(lines(), media_type=NDJSON)


# -- endpoints ---------------------------------------------------------------------------------

@router.post("/api/chat")
async def chat(body: ChatBody, request: Request):
    began = time.perf_counter()
    server = request.app.state.server
    model = served_name(server, body.model)
    if not body.messages:
        return loaded(model, body, chat=True)
    tools, fmt = function_tools(body.tools), constraint(body.format)
    kwargs = template_overrides(server.settings, reasoning_mode_for(think_mode(body.think), fmt, "think"), None)
    # converted, sized and rendered on the prompt pool: 100k small messages hold the event loop ~0.3 s
    ids, points, in_reasoning = await server.prompts.run(
        lambda: server.chat_prompt(template_messages(body.messages), tools, kwargs))
    check_answer_start(fmt, in_reasoning, "format")
    gen = surface_request(server, body, ids, points, fmt)
    return await answer(request, body, gen, in_reasoning, parse_tools=bool(tools), chat=True, began=began)


@router.post("/api/generate")
async def generate(body: GenerateBody, request: Request):
    began = time.perf_counter()
    server = request.app.state.server
    model = served_name(server, body.model)
    for field in ("images", "template", "context"):
        if getattr(body, field):
            raise APIError(400, f"{field} is not supported by this server"
                           + (" (text models only)" if field == "images" else "")
                           + ("; send the conversation to /api/chat" if field == "context" else ""), param=field)
    if not body.prompt:
        return loaded(model, body, chat=False)
    fmt = constraint(body.format)
    if body.suffix:  # fill-in-the-middle, the prompt the prefix (no template, as Ollama's FIM templates)
        ids, points, in_reasoning = await server.prompts.run(fim.prompt, server, body.prompt, body.suffix), None, None
    elif body.raw:  # the prompt as is: no template, no reasoning split (as Ollama)
        server.prompts.check_size(body.prompt)
        ids, points, in_reasoning = await server.prompts.run(server.encode_text, body.prompt), None, None
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": body.prompt}]
        kwargs = template_overrides(server.settings, reasoning_mode_for(think_mode(body.think), fmt, "think"), None)
        server.prompts.check_size(messages)
        ids, points, in_reasoning = await server.prompts.run(server.chat_prompt, messages, None, kwargs)
        check_answer_start(fmt, in_reasoning, "format")
    gen = surface_request(server, body, ids, points, fmt)
    gen = fim.with_fim_stops(server, gen) if body.suffix else gen
    return await answer(request, body, gen, in_reasoning, parse_tools=False, chat=False, began=began)


@router.get("/api/tags")
async def tags(request: Request):
    server = request.app.state.server
    return {"models": [model_details(server.spec, server.settings.model_name)]}


@router.post("/api/show")
async def show(body: ShowBody, request: Request):
    server = request.app.state.server
    served_name(server, body.model or body.name)
    return show_model(server.spec, server.settings.model_name)


@router.get("/api/ps")
async def ps(request: Request):
    server = request.app.state.server
    return {"models": [running_model(server.spec, server.settings.model_name)]}


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse, include_in_schema=False)
async def root():
    return "Ollama is running"  # what Ollama's clients look for to tell a server is there


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_VERSION, "mlxspec": __version__}
