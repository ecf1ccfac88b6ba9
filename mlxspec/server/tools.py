"""Tool calls in generated text, in the Qwen / Hermes format the chat templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallParser` splits a stream of text deltas into plain text and finished calls, holding
back only what could still be the start of a ``<tool_call>`` tag.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _not_json(text: str):
    raise ValueError(f"{text} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _not_json(text)


def strict_json(text: str):
    """TEXT as standard JSON: Python's json also reads NaN, Infinity and 1e309 (infinity), which
    no JSON response can carry (ValueError, as for text that is not JSON)."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict

    @classmethod
    def parse(cls, body: str) -> "ToolCall | None":
        """The call in BODY (the text between the tags); None: not a call (JSON no response
        could carry, e.g. NaN or an integer past 4,300 digits, is not one)."""
        try:
            data = strict_json(body.strip())
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = strict_json(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return cls(id="call_" + uuid.uuid4().hex[:24], name=data["name"], arguments=args)


class ToolCallParser:
    def __init__(self):
        self.buffer = ""
        self.in_call = False

    def feed(self, delta: str) -> list["str | ToolCall"]:
        """Plain-text pieces and finished tool calls, in order."""
        self.buffer += delta
        out: list[str | ToolCall] = []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
                self.in_call = False
                call = ToolCall.parse(body)
                out.append(call if call is not None else OPEN + body + CLOSE)  # not a call: keep it as text
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(OPEN):]
                self.in_call = True
                continue
            keep = next((n for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                         if self.buffer.endswith(OPEN[:n])), 0)
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            if text:
                out.append(text)
            return out

    def finish(self) -> list["str | ToolCall"]:
        """What is left when generation ends: an unclosed call is returned as text."""
        rest = (OPEN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return [rest] if rest else []
