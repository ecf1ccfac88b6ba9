"""OpenAI surface: /v1/chat/completions and /v1/completions, streaming (SSE) or not, with tools."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from .. import reasoning
from ..api import GenerationRequest
from ..errors import UsageError
from ..options import REASONING_MODES, ConstraintSpec
from . import fim
from .chat_messages import CHAT_ROLES, content_text, function_tools, message_role
from .common import (
    APIError,
    DraftMarks,
    EventStream,
    Outcome,
    SurfaceRequest,
    speculation_overrides,
    started,
    template_overrides,
)
from .contract import check_options, check_stop_strings, token_biases
from .json_limits import check_json_text
from .openai_requests import ChatRequest, CompletionRequest, Message, SamplingFields
from .parsing import OffLoopRoute
from .structured import (
    LogprobRenderer,
    chat_logprobs,
    check_answer_start,
    completion_logprobs,
    reasoning_mode_for,
    request_constraint,
)
from .tools import ToolCall, ToolCallParser

router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop


# OpenAI's roles -> the template's: "developer" is what its newer clients send for "system" (a
# template would write it as a turn of a role its model never saw)
ROLES = {**CHAT_ROLES, "developer": "system"}


def _text(content, role: str, where: str) -> str:
    """A message's text: the string, or its text parts joined (an assistant's refusal parts too).
    Only an assistant's may be null (a turn of tool calls)."""
    if content is None and role == "assistant":
        return ""
    if content is None:
        raise APIError(400, f"{where} must be a string or a list of text parts for a {role} message", param=where)
    return content_text(content, where, ("text", "refusal") if role == "assistant" else ("text",), "text")


def _tool_call(call: dict, where: str) -> dict:
    """An assistant's tool call as chat templates want it (arguments a mapping)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where}.function must be an object with a string name", param=f"{where}.function")
    fn = dict(fn)
    args = fn.get("arguments")
    if isinstance(args, str):  # templates want a mapping
        check_json_text(args, f"{where}.function.arguments")
        try:
            args = fn["arguments"] = json.loads(args)
        except ValueError:  # not JSON, or an integer past Python's 4,300 digits
            raise APIError(400, f"{where}.function.arguments is not valid JSON",
                           param=f"{where}.function.arguments") from None
    if args is not None and not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise APIError(400, f"{where}.id must be a string", param=f"{where}.id")
    return {"type": "function", "id": call.get("id"), "function": fn}


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # "none" turns reasoning off


def _effort_mode(effort, param: str) -> str:
    if effort not in EFFORTS:
        raise APIError(400, f"{param} must be one of {', '.join(EFFORTS)}", param=param)
    return "off" if effort == "none" else "on"


def reasoning_mode(body: "ChatRequest") -> str | None:
    """on / off / auto from the body's ``reasoning`` and ``reasoning_effort``; None: neither given."""
    modes = []
    r = body.reasoning
    if isinstance(r, str):
        if r not in REASONING_MODES:
            raise APIError(400, f"reasoning must be one of {', '.join(REASONING_MODES)} or an object",
                           param="reasoning")
        modes.append(r)
    elif isinstance(r, dict):
        unknown = set(r) - {"enabled", "effort", "max_tokens"}
        if unknown:
            raise APIError(400, f"unknown reasoning field(s): {', '.join(sorted(unknown))}", param="reasoning")
        if "enabled" in r:
            if not isinstance(r["enabled"], bool):
                raise APIError(400, "reasoning.enabled must be true or false", param="reasoning.enabled")
            modes.append("on" if r["enabled"] else "off")
        if "effort" in r:
            modes.append(_effort_mode(r["effort"], "reasoning.effort"))
        if "max_tokens" in r:  # a budget is not enforced (the model ends its own reasoning); 0 is off
            n = r["max_tokens"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise APIError(400, "reasoning.max_tokens must be an integer, 0 or more", param="reasoning.max_tokens")
            modes.append("on" if n else "off")
    elif r is not None:
        raise APIError(400, "reasoning must be \"on\", \"off\", \"auto\" or an object", param="reasoning")
    if body.reasoning_effort is not None:
        modes.append(_effort_mode(body.reasoning_effort, "reasoning_effort"))
    if len(set(modes)) > 1:
        raise APIError(400, "the reasoning fields disagree on whether to reason", param="reasoning")
    return modes[0] if modes else None


def _template_messages(messages: list[Message]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        role = message_role(m.role, ROLES, f"messages.{i}.role")
        msg: dict[str, Any] = {"role": role, "content": _text(m.content, role, f"messages.{i}.content")}
        thought = (m.model_extra or {}).get("reasoning_content")
        if role == "assistant" and isinstance(thought, str) and thought:
            msg["reasoning_content"] = thought  # templates render it where the model should see it
        if m.tool_calls:
            msg["tool_calls"] = [_tool_call(c, f"messages.{i}.tool_calls.{k}") for k, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


OPENAI_STOP_STRINGS = 4  # OpenAI's own bound on stop

# the GenerationRequest options this surface names otherwise (mlx-lm's server's name)
LABELS = {"penalty_window": "repetition_context_size"}


def sampling_options(server, body: SamplingFields) -> dict:
    """GenerationRequest keywords for the body's sampling, penalties and logit_bias, each
    within the OpenAI surface's limits (else a 400 naming the field)."""
    if body.n != 1:
        raise APIError(400, f"n must be 1: this server returns one choice per request, got {body.n}", param="n")
    values = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
              "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
              "repetition_penalty": body.repetition_penalty, "penalty_window": body.repetition_context_size,
              "logit_bias": token_biases(body.logit_bias, server.spec.target.vocab_size)}
    check_options("openai", values, LABELS)
    return {**{k: v for k, v in values.items() if v is not None}, "seed": body.seed}


def _generation(server, body: SamplingFields, options: dict, prompt_ids: list[int], max_tokens: int | None,
                checkpoints: list[int] | None = None, logprobs: int | None = None,
                constraint: ConstraintSpec | None = None) -> SurfaceRequest:
    """The body's generation; OPTIONS: its sampling_options; CHECKPOINTS: where a later turn
    may reuse the caches; LOGPROBS: alternatives per token (None: off); CONSTRAINT: what the
    output must match."""
    max_tokens = max_tokens if max_tokens is not None else min(server.settings.max_tokens_cap, 1024)
    server.check_max_tokens(max_tokens)
    speculation = speculation_overrides(body.speculation, server.settings)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > OPENAI_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
        raise APIError(400, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
    check_stop_strings(stop, "stop", most=OPENAI_STOP_STRINGS)
    try:
        generation = GenerationRequest(max_tokens=max_tokens, **options, **speculation, checkpoints=checkpoints,
                                       logprobs=logprobs, constraint=constraint)
    except UsageError as err:
        raise APIError(400, str(err)) from None
    return SurfaceRequest(prompt_ids=prompt_ids, generation=generation, stop=stop)


def _usage(gen: SurfaceRequest, outcome: Outcome) -> dict:
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": outcome.completion_tokens,
            "total_tokens": len(gen.prompt_ids) + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "speculation": outcome.speculation()}


async def reasoning_pieces(deltas: AsyncIterator[str], in_reasoning: bool) -> AsyncIterator[tuple[str, str]]:
    """("reasoning" | "content", text) pieces of a generation's text deltas."""
    splitter = reasoning.ReasoningSplitter(in_reasoning)
    async with aclosing(deltas):  # closing the pieces stops the generation
        async for delta in deltas:
            for piece in splitter.feed(delta):
                yield piece
    for piece in splitter.finish():
        yield piece


def _fresh_logprobs(outcome: Outcome, render):
    """A function giving RENDER of the logprobs OUTCOME gained since its last call."""
    sent = [0]

    def fresh():
        items = (outcome.logprobs or [])[sent[0]:]
        sent[0] += len(items)
        return render(items)

    return fresh


def _sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _call_json(call: ToolCall, index: int) -> dict:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


async def _folded_message(deltas: AsyncIterator[str], in_reasoning: bool, parse_tools: bool,
                          one_call: bool = False) -> dict:
    """The whole assistant message of a generation: its answer, reasoning and tool calls (the
    first only, with ONE_CALL)."""
    parser = ToolCallParser() if parse_tools else None
    text, thought, calls = "", "", []
    async for kind, delta in reasoning_pieces(deltas, in_reasoning):
        if kind == "reasoning":
            thought += delta
            continue
        for piece in (parser.feed(delta) if parser else [delta]):
            if isinstance(piece, ToolCall):
                if not (one_call and calls):
                    calls.append(piece)
            else:
                text += piece
    for piece in parser.finish() if parser else []:
        text += piece
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if thought:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = [_call_json(c, i) for i, c in enumerate(calls)]
        for c in message["tool_calls"]:
            c.pop("index")
    return message


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    server = request.app.state.server
    server.check_model(body.model)
    if not body.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    options = sampling_options(server, body)
    tools = function_tools(body.tools) if body.tool_choice != "none" else None
    one_call = body.parallel_tool_calls is False  # the calls after the first are left out
    constraint = request_constraint(body, tools, body.tool_choice)
    mode = reasoning_mode_for(reasoning_mode(body), constraint, "reasoning")
    kwargs = template_overrides(server.settings, mode, body.chat_template_kwargs)
    # converted, sized and rendered on the prompt pool: 100k small messages hold the event loop ~0.3 s
    prompt_ids, points, in_reasoning = await server.prompts.run(
        lambda: server.chat_prompt(_template_messages(body.messages), tools, kwargs))
    check_answer_start(constraint, in_reasoning, "response_format")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = chat_logprobs(body.logprobs, body.top_logprobs)
    gen = _generation(server, body, options, prompt_ids, max_tokens, checkpoints=points, logprobs=logprobs,
                      constraint=constraint)
    outcome = Outcome()
    rid, created, model = "chatcmpl-" + uuid.uuid4().hex, int(time.time()), server.settings.model_name
    deltas = server.generate(request, gen, outcome)
    fresh = _fresh_logprobs(outcome, LogprobRenderer(server.spec).chat) if logprobs is not None else None
    if not body.stream:
        message = await _folded_message(deltas, in_reasoning, parse_tools=bool(tools), one_call=one_call)
        finish = "tool_calls" if "tool_calls" in message else outcome.finish_reason
        lp = {"content": fresh(), "refusal": None} if fresh else None
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}],
                "usage": _usage(gen, outcome)}

    deltas = await started(deltas)  # errors before the first byte are still plain HTTP errors
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    marks = DraftMarks(outcome) if body.stream_options and body.stream_options.include_speculation else None

    def choice(delta: dict, finish=None) -> dict:
        # logprobs of the tokens generated since the last chunk ride on the next one
        out = {"index": 0, "delta": delta, "finish_reason": finish}
        if fresh:
            out["logprobs"] = {"content": fresh(), "refusal": None}
        return out

    def text_chunk(head: dict, delta: dict, text: str) -> str:
        # with include_speculation: which of TEXT's characters came from accepted drafts
        extra = {"x_mlxspec": marks.of(text)} if marks else {}
        return _sse({**head, "choices": [choice(delta)], **extra})

    async def events():
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        parser = ToolCallParser() if tools else None
        n_calls = 0
        try:
            async for kind, delta in reasoning_pieces(deltas, in_reasoning):
                if kind == "reasoning":
                    yield text_chunk(head, {"reasoning_content": delta}, delta)
                    continue
                for piece in (parser.feed(delta) if parser else [delta]):
                    if isinstance(piece, ToolCall) and one_call and n_calls:
                        continue
                    if isinstance(piece, ToolCall):
                        d = {"tool_calls": [_call_json(piece, n_calls)]}
                        n_calls += 1
                    else:
                        yield text_chunk(head, {"content": piece}, piece)
                        continue
                    yield _sse({**head, "choices": [choice(d)]})
            for piece in parser.finish() if parser else []:
                yield text_chunk(head, {"content": piece}, piece)
        except APIError as err:
            yield _sse({"error": {"message": err.message, "type": err.kind, "code": err.status}})
            return
        finish = "tool_calls" if n_calls else outcome.finish_reason
        yield _sse({**head, "choices": [choice({}, finish)]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(gen, outcome)})
        yield "data: [DONE]\n\n"

    return EventStream(events())


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server = request.app.state.server
    server.check_model(body.model)
    if body.best_of not in (None, 1):
        raise APIError(400, f"best_of must be 1: this server returns one completion per request, got {body.best_of}",
                       param="best_of")
    options = sampling_options(server, body)
    if body.suffix is not None:  # fill-in-the-middle: the prompt is the prefix
        if not isinstance(body.prompt, str):
            raise APIError(400, "suffix needs a text prompt (the prefix), not token ids", param="suffix")
        prompt_ids = await server.prompts.run(fim.prompt, server, body.prompt, body.suffix)
    elif isinstance(body.prompt, str):
        if not body.prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        server.prompts.check_size(body.prompt)
        prompt_ids = await server.prompts.run(server.encode_text, body.prompt)
    else:
        prompt_ids = list(body.prompt)
        vocab = server.spec.target.vocab_size
        if not prompt_ids or any(t < 0 or t >= vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be a non-empty list in [0, {vocab})", param="prompt")
    logprobs = completion_logprobs(body.logprobs)
    gen = _generation(server, body, options, prompt_ids, body.max_tokens, logprobs=logprobs,
                      constraint=request_constraint(body))
    gen = fim.with_fim_stops(server, gen) if body.suffix is not None else gen
    outcome = Outcome()
    rid, created, model = "cmpl-" + uuid.uuid4().hex, int(time.time()), server.settings.model_name
    prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    deltas = server.generate(request, gen, outcome)
    fresh = None
    if logprobs is not None:
        renderer, offset = LogprobRenderer(server.spec), [len(prefix)]

        def completion_json(items) -> dict:  # text offsets run on over the chunks
            out = renderer.completion(items, offset[0], logprobs)
            offset[0] += sum(len(t) for t in out["tokens"])
            return out

        fresh = _fresh_logprobs(outcome, completion_json)
    if not body.stream:
        text = prefix + "".join([d async for d in deltas])
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": outcome.finish_reason,
                             "logprobs": fresh() if fresh else None}],
                "usage": _usage(gen, outcome)}

    deltas = await started(deltas)

    async def events():
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if prefix:
            yield _sse({**head, "choices": [{"index": 0, "text": prefix, "finish_reason": None}]})
        try:
            async for delta in deltas:
                yield _sse({**head, "choices": [{"index": 0, "text": delta, "finish_reason": None,
                                                 "logprobs": fresh() if fresh else None}]})
        except APIError as err:
            yield _sse({"error": {"message": err.message, "type": err.kind, "code": err.status}})
            return
        yield _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": outcome.finish_reason,
                                         "logprobs": fresh() if fresh else None}],
                    "usage": _usage(gen, outcome)})
        yield "data: [DONE]\n\n"

    return EventStream(events())
