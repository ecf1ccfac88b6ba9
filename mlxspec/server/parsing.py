"""Large JSON bodies parsed and validated off the event loop, so /health and running streams
keep answering while they are.

FastAPI parses a body and validates it against the endpoint's model on the event loop: a 4 MB
chat body of many small messages takes ~0.6 s to validate, and four at once stalled /health
for 2.1 s. A route of :class:`OffLoopRoute` does both on a worker thread when the body is
PARSE_OFF_LOOP_BYTES or more, and hands FastAPI the validated model, which it takes as is.
A thread alone is not enough: pydantic holds the GIL for a whole validation, so the body's
long lists are validated a slice at a time, the loop getting the GIL between slices.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import anyio
import anyio.to_thread
from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError

from ..options import PARSE_OFF_LOOP_BYTES

SLICE = 2000  # list items validated per call: ~10 ms of holding the GIL for small messages


@functools.cache
def parser_slot() -> anyio.CapacityLimiter:
    """The one worker thread at a time that parses large bodies: the event loop competes for the
    GIL with each thread that holds work, so four parsing at once slow /health fourfold, and
    parsing them one after the other takes no longer. Made on first use, inside a request."""
    return anyio.CapacityLimiter(1)


class OffLoopRoute(APIRoute):
    """An APIRoute whose JSON body, when large, is parsed and validated on a worker thread."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler

        async def handle(request: Request) -> Response:
            raw = await request.body()
            if len(raw) < PARSE_OFF_LOOP_BYTES:
                return await handler(request)
            try:
                value = await anyio.to_thread.run_sync(parsed, raw, model, limiter=parser_slot())
            except ValueError:  # not JSON: FastAPI's parser refuses it in its own words
                return await handler(request)
            return await handler(ParsedRequest(request, raw, value))

        return handle


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model of ROUTE's one JSON body parameter; None: it has none."""
    field = getattr(route, "body_field", None)
    if field is None or len(route.dependant.body_params) != 1:
        return None
    model = route.dependant.body_params[0].field_info.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


class ParsedRequest(Request):
    """REQUEST with its body already parsed: ``json()`` is VALUE (the validated model, which
    FastAPI's validation passes through, or the body for FastAPI to refuse in its own words)."""

    def __init__(self, request: Request, raw: bytes, value: Any):
        super().__init__(request.scope, request.receive)
        self._raw, self._value = raw, value

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._value


def parsed(raw: bytes, model: type[BaseModel]) -> Any:
    """RAW as MODEL, validated; when it is not valid, the body (long lists cut after their first
    fault, so FastAPI's own validation finds the same first fault quickly)."""
    value = json.loads(raw)
    if not isinstance(value, dict):
        return value
    value = _lists_validated(value, model)
    try:
        return model.model_validate(value)  # the lists' items are models now: fast
    except ValidationError:
        return value


def _lists_validated(body: dict, model: type[BaseModel]) -> dict:
    """BODY with each long list among MODEL's fields validated a slice at a time."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        items = body.get(key)
        if isinstance(items, list) and len(items) > SLICE:
            body[key] = _validated_in_slices(items, field.annotation)
    return body


def _validated_in_slices(items: list, annotation: Any) -> list:
    """ITEMS validated as ANNOTATION (a list type) a slice at a time; from the first slice at
    fault on, cut: the items before it validated, that slice as given."""
    adapter = _adapter(annotation)
    done: list = []
    for start in range(0, len(items), SLICE):
        part = items[start:start + SLICE]
        try:
            validated = adapter.validate_python(part)
        except ValidationError:
            return done + part
        if not isinstance(validated, list) or len(validated) != len(part):
            return items  # not a list type after all: left to the model's validation
        done.extend(validated)
    return done


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)
