"""Fill-in-the-middle on the server: llama.cpp's ``POST /infill`` (the body and answer of
llama.cpp's server: ``input_prefix``, ``input_suffix``, ``input_extra``, ``prompt``, its
/completion sampling options; ``content``, ``stop``, ``tokens_predicted``, ...), and the FIM
prompt that ``suffix`` on ``/v1/completions`` and Ollama's ``/api/generate`` use.

The prompt is the model's own FIM layout (``mlxspec.models.fim``); a model without FIM tokens
is a 400. The generation stops at any of the layout's tokens (Code Llama's ``<EOT>``, a file
separator...). Prefix, suffix and the other files are all in the prompt, so prompt lookup
drafts from each of them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Union

from fastapi import APIRouter, Request
from pydantic import Field

from ..api import GenerationRequest
from ..errors import UsageError
from ..models import fim
from ..options import MAX_SEED
from .common import APIError, EventStream, Outcome, SurfaceRequest, speculation_overrides, started
from .contract import RequestBody, check_options, check_stop_strings, limit_text
from .parsing import OffLoopRoute

router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop

# llama.cpp's server defaults for /completion and /infill
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def layout(server, param: str) -> fim.FimLayout:
    """The served model's FIM layout (read once); a 400 naming PARAM where it has none."""
    found = getattr(server, "fim_layout", False)
    if found is False:
        vocab = getattr(getattr(server.spec, "target", None), "vocab_size", None)
        found = server.fim_layout = fim.model_layout(server.spec.tokenizer, vocab)
    if found is None:
        raise APIError(400, f"{param}: {fim.NO_FIM_MESSAGE}", param=param)
    return found


def prompt(server, prefix: str, suffix: str, param: str = "suffix", extra=None, after: str = "") -> list[int]:
    """The FIM prompt's ids (blocking: run it on ``server.prompts``); PARAM: the field that
    asked for FIM (named in the 400 of a model without FIM tokens)."""
    found = layout(server, param)
    server.prompts.check_size(prefix, suffix, after, [text for _, text in extra or []])
    return fim.prompt_ids(server.spec.tokenizer, found, prefix, suffix, extra=extra, prompt=after)


def with_fim_stops(server, gen: SurfaceRequest) -> SurfaceRequest:
    """GEN also stopping at the layout's tokens (a middle never holds one)."""
    found = layout(server, "suffix")
    return dataclasses.replace(gen, stop=gen.stop + [s for s in fim.stop_texts(server.spec.tokenizer, found)
                                                     if s not in gen.stop])


class ExtraChunk(RequestBody):
    IGNORED = {"time": "when the editor took the chunk (llama.vim, llama.vscode): the order given is used"}
    text: str
    filename: str = "tmp"  # llama.cpp's default


class InfillRequest(RequestBody):
    # fields the llama.cpp editor plugins (llama.vim, llama.vscode) send, accepted with no effect
    IGNORED = {
        "cache_prompt": "the prefix cache is always on here",
        "id_slot": "one slot here",
        "response_fields": "every field comes back",
        "return_tokens": "the streamed chunks' tokens are not listed here",
        "samplers": "the sampler order here is fixed (penalties, top_k, top_p, min_p, temperature)",
        "t_max_prompt_ms": "no prompt time limit here: n_predict bounds the work",
        "t_max_predict_ms": "no generation time limit here: n_predict bounds the answer",
        "n_indent": "no indentation stop here: stop strings and n_predict end the answer",
    }
    model: Optional[str] = None
    input_prefix: str
    input_suffix: str
    input_extra: Optional[list[ExtraChunk]] = None
    prompt: str = Field("", description="text added right after the prefix (llama.cpp's)")
    n_predict: int = Field(-1, description="tokens at most; -1: until the model stops (the server's cap)")
    temperature: float = Field(DEFAULTS["temperature"], description=limit_text("temperature", "openai"))
    top_k: int = Field(DEFAULTS["top_k"], description=limit_text("top_k", "openai"))
    top_p: float = Field(DEFAULTS["top_p"], description=limit_text("top_p", "openai"))
    min_p: float = Field(DEFAULTS["min_p"], description=limit_text("min_p", "openai"))
    seed: Optional[int] = Field(None, ge=-1, le=MAX_SEED, description="-1: a random seed")
    stop: Union[str, list[str], None] = None
    stream: bool = False
    speculation: Optional[dict] = None


def _surface_request(server, body: InfillRequest, ids: list[int]) -> SurfaceRequest:
    n = server.settings.max_tokens_cap if body.n_predict in (-1, -2) else body.n_predict
    server.check_max_tokens(n, "n_predict")
    values = {k: getattr(body, k) for k in DEFAULTS}
    check_options("openai", values)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    check_stop_strings(stop, "stop")
    seed = body.seed if body.seed is not None and body.seed >= 0 else None
    try:
        generation = GenerationRequest(max_tokens=n, **values, seed=seed,
                                       **speculation_overrides(body.speculation, server.settings))
    except UsageError as err:
        raise APIError(400, str(err)) from None
    return with_fim_stops(server, SurfaceRequest(prompt_ids=ids, generation=generation, stop=[s for s in stop if s]))


def _final(server, body: InfillRequest, gen: SurfaceRequest, outcome: Outcome, user_stops: list[str]) -> dict:
    """llama.cpp's last /completion object: counts, why it stopped, timings."""
    s = outcome.stats
    word = outcome.stop_sequence if outcome.stop_sequence in user_stops else ""
    stop_type = "limit" if outcome.finish_reason == "length" else "word" if word else "eos"
    n_prompt, n_out = len(gen.prompt_ids), outcome.completion_tokens
    prompt_ms, out_ms = s.prompt_time_s * 1e3, s.decode_time_s * 1e3
    g = gen.generation
    return {
        "index": 0, "id_slot": 0, "stop": True, "model": server.settings.model_name,
        "tokens_predicted": n_out, "tokens_evaluated": n_prompt, "tokens_cached": outcome.cached_tokens,
        "truncated": False, "stop_type": stop_type, "stopping_word": word, "has_new_line": "\n" in outcome.text,
        "generation_settings": {"n_predict": g.max_tokens, "temperature": g.temperature, "top_k": g.top_k,
                                "top_p": g.top_p, "min_p": g.min_p, "seed": g.seed, "stop": user_stops,
                                "stream": body.stream},
        "timings": {"prompt_n": n_prompt - outcome.cached_tokens, "prompt_ms": prompt_ms,
                    "prompt_per_token_ms": prompt_ms / max(n_prompt - outcome.cached_tokens, 1),
                    "prompt_per_second": (n_prompt - outcome.cached_tokens) / s.prompt_time_s
                    if s.prompt_time_s > 0 else 0.0,
                    "predicted_n": n_out, "predicted_ms": out_ms,
                    "predicted_per_token_ms": out_ms / max(n_out, 1),
                    "predicted_per_second": n_out / s.decode_time_s if s.decode_time_s > 0 else 0.0},
        "speculation": outcome.speculation(),
    }


@router.post("/infill")
async def infill(body: InfillRequest, request: Request):
    server = request.app.state.server
    server.check_model(body.model)
    layout(server, "input_prefix")  # a model without FIM tokens: 400 before any work
    extra = [(c.filename, c.text) for c in body.input_extra or []]
    ids = await server.prompts.run(prompt, server, body.input_prefix, body.input_suffix, "input_prefix",
                                   extra, body.prompt)
    gen = _surface_request(server, body, ids)
    user_stops = [s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if s]
    outcome = Outcome()
    deltas = server.generate(request, gen, outcome)
    if not body.stream:
        text = "".join([d async for d in deltas])
        return {"content": text, "tokens": [], **_final(server, body, gen, outcome, user_stops)}

    deltas = await started(deltas)  # errors before the first byte are still plain HTTP errors

    async def events():
        try:
            async for delta in deltas:
                chunk = {"index": 0, "content": delta, "tokens": [], "stop": False, "id_slot": 0,
                         "tokens_predicted": outcome.completion_tokens, "tokens_evaluated": len(gen.prompt_ids)}
                yield f"data: {json.dumps(chunk)}\n\n"
        except APIError as err:
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.kind, 'code': err.status}})}\n\n"
            return
        final = {"content": "", "tokens": [], **_final(server, body, gen, outcome, user_stops)}
        yield f"data: {json.dumps(final)}\n\n"

    return EventStream(events())

