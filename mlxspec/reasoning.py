"""Reasoning ("thinking") of Qwen3-style models: the chat template's switch, and the split of
generated text into its ``<think>...</think>`` reasoning and the answer.

Qwen3 templates leave ``<think>`` for the model to write; Qwen3.5/3.6 end the generation prompt
with ``<think>\\n`` when thinking is on, so their output starts inside the reasoning and only
``</think>`` appears in it. :func:`starts_in_reasoning` tells the two apart from the prompt.
No mlx import here: the CLI and the config use it before any model is loaded.
"""

from __future__ import annotations

from .options import REASONING_MODES as MODES

OPEN, CLOSE = "<think>", "</think>"
_TAIL = 256  # prompt tokens looked at: the generation prompt plus an assistant prefill


def template_kwargs(mode: str) -> dict:
    """Chat-template variables for MODE; auto leaves the template (and mlx-lm) to decide."""
    if mode not in MODES:
        raise ValueError(f"unknown reasoning mode {mode!r}; choose one of {', '.join(MODES)}")
    return {} if mode == "auto" else {"enable_thinking": mode == "on"}


def constrained_mode(mode: str | None) -> str:
    """The reasoning mode of a request with constrained output (a JSON schema, a regex, a
    forced tool call): the constraint holds from the answer's first token, so reasoning is off
    unless asked for, and asked for it is refused (ValueError): the constraint would hold the
    reasoning to the schema too."""
    if mode == "on":
        raise ValueError("constrained output holds from the first token and cannot follow reasoning: "
                         "turn reasoning off for this request")
    return "off"


def starts_in_reasoning(tokenizer, prompt_ids) -> bool:
    """Whether the prompt ends inside an unclosed ``<think>``, so generation begins in reasoning.

    Only the text after the prompt's last special token (``<|im_start|>`` ...) counts: a
    ``<think>`` in an earlier turn, e.g. a user asking about the tag, does not open anything."""
    ids = list(prompt_ids[-_TAIL:])
    specials = set(getattr(tokenizer, "all_special_ids", None) or [])
    start = 0
    for i in range(len(ids) - 1, -1, -1):
        # some tokenizers mark the think tags themselves special: they are not turn boundaries
        if ids[i] in specials and tokenizer.decode([ids[i]]).strip() not in (OPEN, CLOSE):
            start = i + 1
            break
    text = tokenizer.decode(ids[start:])
    at = text.rfind(OPEN)
    return at >= 0 and text.find(CLOSE, at) < 0


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of TEXT that could begin TAG."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class ReasoningSplitter:
    """Splits streamed text into ("reasoning", text) and ("content", text) pieces.

    The tags are removed, as are the newlines right after ``<think>`` and ``</think>`` and those
    right before ``</think>`` (what the chat templates strip when they render a past turn, so a
    reasoning sent back renders as the model wrote it). Only a possible partial tag, and in
    reasoning its trailing newlines, are held back between calls."""

    def __init__(self, in_reasoning: bool = False):
        self.in_reasoning = in_reasoning
        self._buffer = ""
        self._after_tag = in_reasoning  # the prompt's <think> is the tag just seen

    def _kind(self) -> str:
        return "reasoning" if self.in_reasoning else "content"

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        out: list[tuple[str, str]] = []
        while True:
            if self._after_tag:
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer:  # more newlines may follow
                    return out
                self._after_tag = False
            tag = CLOSE if self.in_reasoning else OPEN
            at = self._buffer.find(tag)
            if at >= 0:
                piece = self._buffer[:at]
                if self.in_reasoning:
                    piece = piece.rstrip("\n")
                if piece:
                    out.append((self._kind(), piece))
                self._buffer = self._buffer[at + len(tag):]
                self.in_reasoning = not self.in_reasoning
                self._after_tag = True
                continue
            end = len(self._buffer) - _partial(self._buffer, tag)
            piece = self._buffer[:end]
            if self.in_reasoning:  # newlines that may turn out to precede </think>
                piece = piece.rstrip("\n")
            if piece:
                out.append((self._kind(), piece))
                self._buffer = self._buffer[len(piece):]
            return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held back when the text ends: an unfinished tag is plain text."""
        rest, self._buffer = self._buffer, ""
        if self.in_reasoning:
            rest = rest.rstrip("\n")
        return [(self._kind(), rest)] if rest else []


def split(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole text."""
    splitter = ReasoningSplitter(in_reasoning)
    parts = {"reasoning": "", "content": ""}
    for kind, piece in splitter.feed(text) + splitter.finish():
        parts[kind] += piece
    return parts["reasoning"], parts["content"]
