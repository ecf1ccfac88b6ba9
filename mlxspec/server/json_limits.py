"""What a JSON request body may not hold, checked once on its raw bytes before any surface
parses it: nesting deeper than MAX_JSON_DEPTH (recursive code downstream, sizing a prompt or
rendering a template, would hit Python's recursion limit: a 500) and lone UTF-16 surrogates
(``"\\ud800"`` parses to a str no tokenizer, grammar compiler or JSON response can encode).

Both scans run in C (regular expressions, bytes.translate) and fall back to parsing only when
a cheap test cannot rule the fault out, so a multi-megabyte body costs little on the event loop.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate

from ..options import MAX_JSON_DEPTH
from .common import APIError

_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
# opening brackets count +1, closing -1 (as signed bytes)
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
# a surrogate escape not part of a pair, or a raw UTF-8 encoded surrogate (Python's JSON takes both)
_LONE_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                          rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                          rb"|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text RAW nests arrays and objects more than LIMIT deep (brackets inside
    strings do not count; text that is not JSON is left to the parser to refuse)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # escaped backslashes, then escaped quotes, out: every quote left opens or closes a string,
    # and the brackets between the odd and even quotes are text
    quotes_and_brackets = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    brackets = b"".join(quotes_and_brackets.split(b'"')[::2])
    steps = array("b", brackets.translate(_STEPS))
    return max(accumulate(steps), default=0) > limit


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


def lone_surrogate_at(raw: bytes) -> str | None:
    """Where in the JSON body RAW a string (or a key) holds a lone surrogate, as a dotted path
    ("messages.0.content"; "" for the body itself); None: nowhere (or RAW is not JSON)."""
    if (b"\\ud" not in raw.lower() and b"\xed" not in raw) or not _LONE_ESCAPE.search(raw):
        return None
    try:
        body = json.loads(raw)
    except ValueError:  # the framework's parser refuses it, in its own words
        return None
    pending = [((), body)]  # iterative: RAW is within MAX_JSON_DEPTH, but no recursion is needed
    while pending:
        path, value = pending.pop()
        if isinstance(value, str) and _SURROGATE.search(value):
            return ".".join(path)
        if isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return ".".join((*path, _escaped(key)))
                pending.append(((*path, key), item))
        elif isinstance(value, list):
            pending.extend(((*path, str(i)), item) for i, item in enumerate(value))
    return None


def json_fault(raw: bytes | str, field: str | None = None) -> APIError | None:
    """The 400 refusing the JSON text RAW (the body; or FIELD's value, JSON given as a string),
    naming where the fault is; None: it may go on."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    elif raw and json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):
        # Python's parser reads UTF-16 and UTF-32 too, lone surrogates and all, past the checks
        # below (they read UTF-8 bytes); JSON between systems is UTF-8 (RFC 8259)
        return APIError(400, "the request body must be JSON in UTF-8")
    if too_deep(raw):
        return APIError(400, f"{field or 'the request body'} nests arrays and objects more than {MAX_JSON_DEPTH} deep",
                        param=field)
    where = lone_surrogate_at(raw)
    if where is not None:
        where = ".".join(filter(None, (field, where))) or None
        return APIError(400, f"{where or 'the request body'}: holds a lone UTF-16 surrogate (an unpaired "
                             "\\ud800-\\udfff escape), which is not text", param=where)
    return None


def check_json_text(text: str, field: str) -> None:
    """400 naming FIELD when its value, JSON given as a string, is JSON no surface could take
    (it is parsed after the body, so the body's check did not see inside it)."""
    fault = json_fault(text, field)
    if fault is not None:
        raise fault
