"""The OpenAI surface's structured output and log-probabilities.

Requests: ``response_format`` (json_object, json_schema), ``guided_json`` / ``guided_regex`` /
``guided_grammar`` (vLLM's names, so clients written for it work) and a ``tool_choice`` that
forces a call become one ConstraintSpec; ``logprobs`` / ``top_logprobs`` become the number of
alternatives per token. Responses: the engine's TokenLogprobs as OpenAI renders them.
"""

from __future__ import annotations

import json
import math

from .. import reasoning
from ..options import MAX_TOP_LOGPROBS, ConstraintSpec
from .common import APIError
from .json_limits import check_json_text
from .tools import CLOSE, OPEN

# JSON inside a grammar laid out as the engine lays out JSON schemas (json.dumps style); lenient:
# a tool's parameter schema may use keywords llguidance does not implement (they are ignored)
TOOL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def response_format_constraint(fmt) -> ConstraintSpec | None:
    """``response_format`` (openai_requests.ResponseFormat): text (None), json_object or
    json_schema (its ``schema``; strict or not, the schema is enforced)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ConstraintSpec("json")
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                       param="response_format.json_schema.schema")
    return ConstraintSpec("json_schema", schema)


def guided_json_constraint(schema) -> ConstraintSpec | None:
    """vLLM's ``guided_json``: a JSON schema, as an object or as its JSON text."""
    if isinstance(schema, str):
        check_json_text(schema, "guided_json")
        try:
            schema = json.loads(schema)
        except ValueError:  # not JSON, or an integer past Python's 4,300 digits
            raise APIError(400, "guided_json must be a JSON schema (an object, or its JSON text)",
                           param="guided_json") from None
    if schema is not None and not isinstance(schema, dict):
        raise APIError(400, "guided_json must be a JSON schema object", param="guided_json")
    return ConstraintSpec("json_schema", schema) if schema is not None else None


def _forced_tools(tools: list[dict] | None, choice) -> list[dict] | None:
    """The functions a ``tool_choice`` forces one call of: all for "required", the named one for
    {"type": "function", "function": {"name": ...}}; None when it forces nothing. TOOLS come
    checked, each a function with a string name (``chat_messages.function_tools``, Responses'
    ``chat_tools``, Anthropic's ``template_tools``)."""
    if choice is None or choice in ("auto", "none"):
        return None
    functions = [t["function"] for t in tools or []]
    if choice == "required":
        if not functions:
            raise APIError(400, "tool_choice \"required\" needs tools", param="tool_choice")
        return functions
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    named = [f for f in functions if f.get("name") == name]
    if not named:
        raise APIError(400, f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    return named


def tool_call_grammar(functions: list[dict]) -> str:
    """A Lark grammar for one tool call in the format the chat templates ask for and
    tools.ToolCallParser reads: <tool_call>, the {"name", "arguments"} JSON, </tool_call>."""
    calls = []
    for f in functions:
        params = f.get("parameters") if isinstance(f.get("parameters"), dict) else {"type": "object"}
        calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": calls, "x-guidance": TOOL_JSON_OPTIONS}
    return f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}"


def forced_tool_constraint(tools: list[dict] | None, choice) -> ConstraintSpec | None:
    """The constraint of an OpenAI ``tool_choice`` over TOOLS (OpenAI's form): one call of
    one of the functions it forces; None when it forces none."""
    forced = _forced_tools(tools, choice)
    return ConstraintSpec("grammar", tool_call_grammar(forced)) if forced is not None else None


def request_constraint(body, tools: list[dict] | None = None, tool_choice=None) -> ConstraintSpec | None:
    """The one constraint a body asks for (two at once is a 400)."""
    asked = {}
    for field, constraint in (("response_format", response_format_constraint(body.response_format)),
                              ("guided_json", guided_json_constraint(body.guided_json))):
        if constraint is not None:
            asked[field] = constraint
    for field, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            if not value:
                raise APIError(400, f"{field} must be a non-empty string", param=field)
            asked[field] = ConstraintSpec(kind, value)
    forced = forced_tool_constraint(tools, tool_choice)
    if forced is not None:
        asked["tool_choice"] = forced
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} each constrain the output: give one", param=next(iter(asked)))
    return next(iter(asked.values()), None)


def chat_logprobs(logprobs, top_logprobs) -> int | None:
    """Chat's ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs logprobs) as the engine's
    count of alternatives; None: off."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise APIError(400, "logprobs must be true or false", param="logprobs")
    if top_logprobs is not None:
        if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) \
                or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if not logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def completion_logprobs(logprobs) -> int | None:
    """Completions' ``logprobs``: the integer count of alternatives (0..20); None: off."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="logprobs")
    return logprobs


# what OpenAI writes for a token too unlikely to score (JSON has no -Infinity): a constraint's
# masked tokens, listed among the top alternatives
UNLIKELY_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY_LOGPROB


class LogprobRenderer:
    """TokenLogprobs as OpenAI JSON, a token's text and bytes from the served tokenizer; a
    log-probability JSON cannot carry (-inf: a token a constraint rules out) is UNLIKELY_LOGPROB."""

    def __init__(self, spec):
        self.spec = spec
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token: int) -> bytes:
        if token not in self._bytes:
            self._bytes[token] = self.spec.token_bytes(token)
        return self._bytes[token]

    def token(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def chat(self, items) -> list[dict]:
        """Chat's ``logprobs.content`` entries."""
        def entry(token: int, logprob: float) -> dict:
            return {"token": self.token(token), "logprob": finite_logprob(logprob),
                    "bytes": list(self.token_bytes(token))}

        return [{**entry(p.token, p.logprob), "top_logprobs": [entry(t, v) for t, v in p.top]} for p in items]

    def completion(self, items, offset: int, top: int) -> dict:
        """Completions' ``logprobs`` object; OFFSET: where the first token's text begins."""
        tokens, offsets = [], []
        for p in items:
            offsets.append(offset)
            text = self.token(p.token)
            tokens.append(text)
            offset += len(text)
        tops = [{self.token(t): finite_logprob(v) for t, v in p.top} for p in items] if top else None
        return {"tokens": tokens, "token_logprobs": [finite_logprob(p.logprob) for p in items], "top_logprobs": tops,
                "text_offset": offsets}


def reasoning_mode_for(mode: str | None, constraint: ConstraintSpec | None, param: str) -> str | None:
    """A request's reasoning MODE (None: the server's) as its constraint allows: off with one
    (the constraint holds from the answer's first token), a 400 when reasoning is asked for."""
    if constraint is None:
        return mode
    try:
        return reasoning.constrained_mode(mode)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


def check_answer_start(constraint: ConstraintSpec | None, in_reasoning: bool | None, param: str) -> None:
    """400 when a constrained request's prompt opens in reasoning although reasoning is off (a
    template that always thinks): the constraint would apply to the reasoning."""
    if constraint is not None and in_reasoning:
        raise APIError(400, "this model's chat template starts every answer with reasoning; constrained "
                            "output cannot follow it", param=param)
