"""What a request body may carry, on every surface: the fields each surface declares, the few
its real API defines that are accepted with no effect here (each listed with why, in the
surface's module), and a 400 naming any other field, so a typo or an unsupported option is
never silently dropped. Option values are checked against mlxspec.options' limits, with the
bounds a surface sets on purpose (options.SURFACE_LIMITS).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from ..engine.penalties import check_token_ids
from ..errors import UsageError
from ..options import MAX_STOP_LENGTH, MAX_STOP_STRINGS, check_values, limit_of
from .common import APIError

# the pydantic error type of a field a body may not carry; the error handler reads its field
UNKNOWN_FIELD = "unknown_field"


def unknown_field_message(field: str, hint: str = "") -> str:
    return f"{field}: unknown or unsupported field{hint}"


def typo_hint(field: str, known) -> str:
    """"; did you mean X?" when FIELD looks like a typo of X, one of KNOWN; else empty."""
    close = difflib.get_close_matches(field, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


class RequestBody(BaseModel):
    """A surface's request body: its declared fields, plus IGNORED (field -> why it changes
    nothing here), dropped before validation; any other field is a 400 naming it."""

    # NaN and Infinity (Python's JSON reads both) are no option's value; strict: a value of another
    # JSON type is refused, as the real APIs refuse it (lax, `true` was 1 token, "yes" a stream)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    IGNORED: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def known_fields(cls, data):
        if not isinstance(data, dict):
            return data  # not an object: pydantic's own error says so
        data = {k: v for k, v in data.items() if k not in cls.IGNORED}
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        for field in data:
            if field not in known:  # the error handler makes it a 400 naming the field where it is
                raise PydanticCustomError(UNKNOWN_FIELD, "{field}: unknown or unsupported field{hint}",
                                          {"field": field, "hint": typo_hint(field, known)})
        return data


def unknown_keys(given: Mapping, known, where: str) -> None:
    """400 naming the first key of GIVEN (an object inside a body, e.g. Ollama's options) that
    is not in KNOWN; WHERE: the object's place in the body."""
    for key in given:
        if key not in known:
            raise APIError(400, unknown_field_message(f"{where}.{key}", typo_hint(key, known)),
                           param=f"{where}.{key}")


def check_stop_strings(stops: list[str], param: str, most: int = MAX_STOP_STRINGS, empty_ok: bool = False) -> None:
    """400 naming PARAM when STOPS (strings) are more than MOST, or one is longer than
    MAX_STOP_LENGTH (each is matched against every chunk of the answer), or empty unless
    EMPTY_OK (a surface whose own server drops an empty one, as Ollama's): an empty stop string
    would stop nothing, unseen."""
    if len(stops) > most:
        raise APIError(400, f"{param} takes at most {most} stop strings, got {len(stops)}", param=param)
    for i, stop in enumerate(stops):
        if not stop and not empty_ok:
            raise APIError(400, f"{param}.{i} is empty; a stop string needs at least one character",
                           param=f"{param}.{i}")
        if len(stop) > MAX_STOP_LENGTH:
            raise APIError(400, f"{param}.{i} is {len(stop)} characters; a stop string may have at most "
                                f"{MAX_STOP_LENGTH}", param=f"{param}.{i}")


def limit_text(name: str, surface: str) -> str:
    """What option NAME must be on SURFACE, for the OpenAPI schema's descriptions."""
    return "must be " + limit_of(name, surface)[1]


def check_options(surface: str, values: Mapping[str, object], labels: Mapping[str, str] | None = None) -> None:
    """400 naming the first of VALUES (option -> value; None: not given) outside its bounds on
    SURFACE; LABELS: what the surface calls an option (its field name)."""
    for name, value in values.items():
        label = (labels or {}).get(name, name)
        try:
            check_values({name: value}, {name: label}, surface=surface)
        except UsageError as err:
            raise APIError(400, str(err), param=label) from None


def token_biases(bias: Mapping[str, float] | None, vocab_size: int, param: str = "logit_bias") -> dict | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) as token id -> bias;
    a key that is not a token id of this model is a 400 naming PARAM. The biases' range is
    LIMITS' (check_options)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"{param} keys must be token ids (integers), got {key!r}", param=param) from None
        try:
            check_token_ids([token], vocab_size, param)
        except ValueError as err:
            raise APIError(400, str(err), param=param) from None
        out[token] = value
    return out
