"""Tool calls in generated text, in the Qwen / Hermes format the chat templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallParser` splits a stream of text deltas into plain text and finished calls, holding
back only what could still be the start of a ``<tool_call>`` tag.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict

    @classmethod
    def parse(cls, body: str) -> "ToolCall | None":
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
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
