"""The OpenAI Responses surface's request body (``POST /v1/responses``) and what it becomes on
the chat path: ``input`` items as chat-template messages, flat function tools as chat tools,
``text.format`` and a forcing ``tool_choice`` as the one constraint, ``reasoning.effort`` as a
reasoning mode. Fields OpenAI defines that change nothing here are ``IGNORED`` (each with why);
any other field is a 400 (see ``contract.py``).
"""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import Field

from ..options import ConstraintSpec
from .chat_messages import content_text, message_role
from .common import APIError
from .contract import RequestBody, limit_text
from .json_limits import check_json_text
from .openai import EFFORTS
from .structured import forced_tool_constraint

INCLUDE_IGNORED = ("reasoning.encrypted_content",)  # nothing is encrypted here: the reasoning is sent as text


class TextConfig(RequestBody):
    IGNORED = {"verbosity": "a hint for OpenAI's models' answer length: the model here takes no such hint"}
    format: Optional[dict] = Field(None, description='{"type": "text" | "json_object" | "json_schema", ...}')


class ReasoningConfig(RequestBody):
    effort: Optional[str] = Field(None, description="none: no reasoning; minimal..max: reasoning on")
    summary: Optional[Literal["auto", "concise", "detailed"]] = Field(
        None, description="accepted: the reasoning comes back whole, as reasoning_text, never summarized")
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = Field(None, description="summary's old name")


class StreamOptions(RequestBody):
    IGNORED = {"include_obfuscation": "pads stream events against a length side channel of OpenAI's; "
                                      "a local stream has none to hide"}


class ResponsesRequest(RequestBody):
    IGNORED = {
        "user": "an end-user id for OpenAI's abuse monitoring: nothing is monitored here",
        "safety_identifier": "the same, under its newer name",
        "service_tier": "OpenAI's billing tier: there is one here",
        "prompt_cache_key": "a hint for OpenAI's prompt caching: the prefix cache finds shared prefixes itself",
        "truncation": "the context is never truncated here: a prompt too long is a 400",
    }
    model: Optional[str] = None
    input: Union[str, list[dict], None] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: float = Field(1.0, description=limit_text("temperature", "openai"))
    top_p: float = Field(1.0, description=limit_text("top_p", "openai"))
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one tool call comes back")
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    store: bool = Field(True, description="false: not kept for a later previous_response_id")
    metadata: Optional[dict[str, str]] = Field(None, description="up to 16 tags, echoed in the response")
    include: Optional[list[str]] = Field(None, description=f"only {', '.join(INCLUDE_IGNORED)}, which changes nothing")
    speculation: Optional[dict] = None


# -- input items -> chat-template messages ---------------------------------------------------------

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def item_text(content, where: str) -> str:
    """A message's (or a tool output's) text: the string, or its text parts joined."""
    return content_text(content, where, TEXT_PARTS, "input_text")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def _call(item: dict, where: str) -> dict:
    """A function_call item as an assistant's tool call (arguments a mapping, as templates want)."""
    name, call_id = _string(item, "name", where), _string(item, "call_id", where)
    args = item.get("arguments", "{}")
    if not isinstance(args, str):
        raise APIError(400, f"{where}.arguments must be a string of JSON", param=f"{where}.arguments")
    check_json_text(args, f"{where}.arguments")
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        raise APIError(400, f"{where}.arguments is not valid JSON", param=f"{where}.arguments") from None
    if not isinstance(parsed, dict):
        raise APIError(400, f"{where}.arguments must be a JSON object", param=f"{where}.arguments")
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": parsed}}


def _reasoning_text(item: dict, where: str) -> str:
    parts = item.get("content") or item.get("summary") or []  # our reasoning_text, or a summary
    if not isinstance(parts, list):
        raise APIError(400, f"{where}.content must be a list", param=f"{where}.content")
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    if any(not isinstance(t, str) for t in texts):
        raise APIError(400, f"{where}: reasoning parts need a string text", param=where)
    return "".join(texts)


def input_messages(given: Union[str, list[dict], None]) -> list[dict]:
    """The chat-template messages of a body's ``input``: messages (the developer role as system),
    function_call items as the assistant's tool calls, function_call_output items as tool turns,
    reasoning items as the next assistant turn's reasoning_content."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict] = []
    thought = ""
    for i, item in enumerate(given):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = message_role(item.get("role"), ROLES, f"{where}.role")
            msg = {"role": role, "content": item_text(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought:
                msg["reasoning_content"], thought = thought, ""
            out.append(msg)
        elif kind == "function_call":
            call = _call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # calls after the text of the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought:
                    out[-1]["reasoning_content"], thought = thought, ""
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": item_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            thought += _reasoning_text(item, where)
        else:
            raise APIError(400, f"{where}: input item type {kind!r} is not supported here; use message, "
                                "function_call, function_call_output or reasoning", param=f"{where}.type")
    return out


# -- tools, constraint, reasoning --------------------------------------------------------------

def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools in the chat form templates and the constraint take."""
    out = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function":
            raise APIError(400, f"tools.{i}: tool type {t.get('type')!r} is not supported here; only function "
                                "tools are", param=f"tools.{i}.type")
        name = _string(t, "name", f"tools.{i}")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools.{i}.parameters must be a JSON schema object", param=f"tools.{i}.parameters")
        out.append({"type": "function", "function": {"name": name, "description": t.get("description") or "",
                                                     "parameters": params or {"type": "object", "properties": {}}}})
    return out or None


def chat_tool_choice(choice):
    """Responses' tool_choice in chat's form: auto / none / required, or a named function."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                   param="tool_choice")


def format_constraint(text: TextConfig | None) -> ConstraintSpec | None:
    """``text.format``: text (None), json_object, or json_schema (its ``schema``, enforced)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return ConstraintSpec("json")
    if fmt.get("type") != "json_schema":
        raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format.schema must be a JSON schema object", param="text.format.schema")
    return ConstraintSpec("json_schema", fmt["schema"])


def constraint_of(body: ResponsesRequest, tools: list[dict] | None) -> ConstraintSpec | None:
    """The one constraint: text.format's or a forcing tool_choice's (both: a 400)."""
    fmt = format_constraint(body.text)
    forced = forced_tool_constraint(tools, chat_tool_choice(body.tool_choice))
    if fmt is not None and forced is not None:
        raise APIError(400, "text.format and tool_choice each constrain the output: give one", param="text.format")
    return fmt or forced


def reasoning_mode(body: ResponsesRequest) -> str | None:
    """on / off from ``reasoning.effort`` (none: off), as chat's reasoning_effort; None: not given."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise APIError(400, f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning.effort")
    return "off" if effort == "none" else "on"


def check_body(body: ResponsesRequest) -> None:
    """What the fields' types alone do not say."""
    if body.metadata is not None and len(body.metadata) > 16:
        raise APIError(400, "metadata takes at most 16 keys", param="metadata")
    for i, entry in enumerate(body.include or []):
        if entry not in INCLUDE_IGNORED:
            raise APIError(400, f"include.{i}: {entry!r} is not supported here", param=f"include.{i}")
