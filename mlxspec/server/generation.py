"""Generation for every surface: the :class:`Server` checks what a request asks, renders its
prompt (off the event loop, see ``prompts.py``), runs it on the worker and streams text deltas
back, cut at the request's stop strings; a client that leaves, queued or running, cancels it.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from fastapi import Request

from .. import reasoning
from ..errors import MlxspecError
from .common import APIError, Outcome, ServedModel, Settings, SurfaceRequest
from .metrics import Metrics
from .prompts import PromptWork
from .sharded import Leader
from .worker import QueueFull, Worker

log = logging.getLogger("mlxspec.server")


def stop_at(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the first stop string in TEXT begins, and which one it is; None: none there."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits) if hits else None


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of TEXT that could begin a stop string (not sent yet). Only the
    places in TEXT's last len(stop) - 1 characters where the stop's first character occurs are
    tried (each a C-level comparison), not every prefix of every stop."""
    keep = 0
    for s in stops:
        if not s:
            continue
        i = text.find(s[0], max(len(text) - len(s) + 1, 0))
        while i != -1 and len(text) - i > keep:
            if s.startswith(text[i:]):
                keep = len(text) - i
                break
            i = text.find(s[0], i + 1)
    return keep


async def request_errors(chunks):
    """The engine refuses what the request asked for (e.g. drafter mtp on a model without a
    head) with an MlxspecError: that is the client's 400, on every surface."""
    try:
        async for chunk in chunks:
            yield chunk
    except MlxspecError as err:
        raise APIError(400, str(err)) from None


class Server:
    """The one loaded model behind every surface, with its worker and metrics."""

    def __init__(self, spec: ServedModel, settings: Settings):
        self.spec = spec
        self.settings = settings
        # a target sharded by mlx.launch: the worker runs each generation on every rank, one at a time
        self.group = getattr(getattr(spec, "target", None), "group", None)
        runs = spec if self.group is None else Leader(spec, self.group)
        self.worker = Worker(runs, settings.max_queue, settings.max_batch if self.group is None else 1)
        self.prompts = PromptWork(spec, settings.prompt_workers, settings.max_queue)
        self.metrics = Metrics()

    def close(self) -> None:
        """The server is done: generations still there end with a 503; a sharded target's
        worker ends, then its followers (they wait for every generation rank 0 runs)."""
        self.worker.stop(APIError(503, "the server is shutting down", kind="overloaded_error"))
        if self.group is not None:
            self.worker.close()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(404, f"model '{name}' is not served here; this server serves "
                                f"'{self.settings.model_name}'", kind="not_found_error", param="model")

    def check_max_tokens(self, n: int, param: str = "max_tokens") -> None:
        if n < 1:
            raise APIError(400, f"{param} must be at least 1", param=param)
        if n > self.settings.max_tokens_cap:
            raise APIError(400, f"{param} {n} is above this server's cap of {self.settings.max_tokens_cap}",
                           param=param)

    def encode_chat(self, messages: list[dict], tools: list | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """The chat's token ids (blocking: surfaces run it through ``self.prompts``)."""
        self.prompts.check_size(messages, tools)
        try:
            return self.spec.encode(messages, tools=tools, template_kwargs=template_kwargs)
        except Exception as err:  # jinja raises many types on odd messages
            raise APIError(400, f"the chat template rejected these messages: {' '.join(str(err).split())[:200]}")

    def reuse_points(self, messages: list[dict], prompt_ids: list[int], tools: list | None = None,
                     template_kwargs: dict | None = None) -> list[int]:
        """Where the next turn of this conversation will share the prompt (the prefix cache
        keeps a hybrid model's state there)."""
        return self.spec.reuse_points(messages, prompt_ids, tools=tools, template_kwargs=template_kwargs)

    def encode_text(self, text: str) -> list[int]:
        """A raw prompt's token ids (blocking, as :meth:`encode_chat`)."""
        self.prompts.check_size(text)
        return list(self.spec.tokenizer.encode(text))

    def chat_prompt(self, messages: list[dict], tools: list | None,
                    template_kwargs: dict | None) -> tuple[list[int], list[int], bool]:
        """(token ids, reuse points, whether it starts in reasoning) of a chat (blocking)."""
        ids = self.encode_chat(messages, tools, template_kwargs)
        return ids, self.reuse_points(messages, ids, tools, template_kwargs), self.starts_in_reasoning(ids)

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        return reasoning.starts_in_reasoning(self.spec.tokenizer, prompt_ids)

    async def generate(self, request: Request, gen: SurfaceRequest, outcome: Outcome) -> AsyncIterator[str]:
        """Text deltas of one generation; OUTCOME is complete when the iterator ends."""
        if not gen.prompt_ids:
            raise APIError(400, "the prompt is empty")
        try:
            job = self.worker.submit(gen.prompt_ids, gen.generation)
        except QueueFull:
            raise APIError(503, f"the server is busy ({self.settings.max_queue} requests queued); retry shortly",
                           kind="overloaded_error", headers={"Retry-After": "1"}) from None
        held, started, ended = "", time.perf_counter(), False
        # every token's logprobs; outcome.logprobs gets those of the text released so far (text
        # held back as a possible stop string holds its tokens' logprobs back too)
        scored: list | None = None
        try:
            async for chunk in request_errors(job.chunks(gone=request.is_disconnected)):
                outcome.completion_tokens += len(chunk.tokens)
                outcome.stats = chunk.stats
                if chunk.logprobs is not None:
                    eos = self.spec.tokenizer.eos_token_ids
                    scored = scored if scored is not None else []
                    scored.extend(p for p in chunk.logprobs if p.token not in eos)
                    outcome.logprobs = outcome.logprobs if outcome.logprobs is not None else []
                if chunk.drafted_chars:  # where it lands in the whole text
                    at = len(outcome.text) + len(held)
                    outcome.add_drafted(at, at + chunk.drafted_chars)
                held += chunk.text
                hit = stop_at(held, gen.stop)
                if hit is not None:
                    cut, outcome.stop_sequence = hit
                    outcome.finish_reason = "stop"
                    outcome.text += held[:cut]
                    if scored is not None:  # the tokens of the text before the stop string
                        outcome.logprobs = scored[:self._tokens_within(scored, outcome.text)]
                    if held[:cut]:
                        yield held[:cut]
                    held = ""
                    break
                safe = len(held) - held_back(held, gen.stop)
                if safe > 0:
                    outcome.text += held[:safe]
                    held = held[safe:]
                    if scored is not None and not held:
                        outcome.logprobs.extend(scored[len(outcome.logprobs):])
                    yield outcome.text[-safe:]
            else:
                if job.cancelled.is_set():  # the client left: nobody reads the rest
                    return
                if scored is not None:
                    outcome.logprobs.extend(scored[len(outcome.logprobs):])
                if held:
                    outcome.text += held
                    yield held
                outcome.finish_reason = outcome.stats.finish_reason or "stop"
            ended = True
        except Exception:
            outcome.finish_reason, ended = "error", True
            raise
        finally:
            if not ended:  # the client left, or the server stopped it (shutting down)
                outcome.finish_reason = "cancelled"
            job.cancel()
            self._account(gen, outcome, time.perf_counter() - started)

    def _tokens_within(self, scored: list, text: str) -> int:
        """How many of SCORED's tokens decode to no more than TEXT (a stop string cut it)."""
        tokens = [p.token for p in scored]
        lo, hi = 0, len(tokens)
        while lo < hi:  # the largest n whose decoded prefix fits
            mid = (lo + hi + 1) // 2
            if len(self.spec.tokenizer.decode(tokens[:mid])) <= len(text):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _account(self, gen: SurfaceRequest, outcome: Outcome, seconds: float) -> None:
        """Count a finished generation in the metrics and log one line for it."""
        spec = outcome.speculation()
        self.metrics.count_generation(len(gen.prompt_ids), outcome.completion_tokens, outcome.stats)
        log.info("prompt=%d cached=%d completion=%d finish=%s drafter=%s drafted=%d accepted=%d %.2fs",
                 len(gen.prompt_ids), outcome.cached_tokens, outcome.completion_tokens, outcome.finish_reason,
                 spec["drafter"], spec["drafted"], spec["accepted"], seconds)
