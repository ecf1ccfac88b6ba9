"""A chat message's pieces as the chat templates take them, checked the same way on every
surface: its role, its text, the function tools beside it. What a template would not render,
or would render as nothing (an unknown role, an image part of a text model's prompt, a tool
without a name), is a 400 naming the field, never a part left out of the prompt unseen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .common import APIError

# a surface's role -> the template's: the roles every chat template here renders
CHAT_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def message_role(role, roles: Mapping[str, str], where: str) -> str:
    """ROLE as the template takes it (ROLES: the surface's roles -> the template's), else a 400
    naming WHERE and the roles it takes."""
    if not isinstance(role, str) or role not in roles:
        raise APIError(400, f"{where} must be one of {', '.join(roles)}, got {role!r}", param=where)
    return roles[role]


def content_text(content, where: str, parts: Sequence[str], use: str) -> str:
    """A message's text: the string, or the text of its content parts joined. PARTS: the part
    types read as text (a ``refusal`` part's text is its ``refusal``); any other part (an
    image, audio, a file: the models served here read text only) is a 400 naming it and saying
    to USE, as is a part without a string text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of {use} parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in parts:
            raise APIError(400, f"{where}.{j}: content part type {kind!r} is not supported here "
                                f"(text models only); use {use}", param=f"{where}.{j}")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise APIError(400, f"{where}.{j}.{key} must be a string", param=f"{where}.{j}.{key}")
        texts.append(part[key])
    return "".join(texts)


def function_tools(tools: list | None, param: str = "tools") -> list[dict] | None:
    """TOOLS in OpenAI's and Ollama's form (``{"type": "function", "function": {"name", ...}}``,
    the type optional) as the templates take them, type set; None for none. A tool of another
    type, or a function without a string name, or with parameters that are not a JSON schema
    object or a description that is not a string, is a 400 naming it."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"{param}.{i}"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        if tool.get("type", "function") != "function":
            raise APIError(400, f"{where}.type must be \"function\" (the one kind of tool served here), "
                                f"got {tool['type']!r}", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}.function must be an object with a string name", param=f"{where}.function")
        for key, kind, what in (("parameters", dict, "a JSON schema object"), ("description", str, "a string")):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise APIError(400, f"{where}.function.{key} must be {what}", param=f"{where}.function.{key}")
        out.append({**tool, "type": "function"})
    return out
