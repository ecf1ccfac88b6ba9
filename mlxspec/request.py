"""What a generation asks for (GenerationRequest) and what it gives back (Chunk, Result):
the values the CLI, the server, the bench and the Python API pass to ``SpecModel``, checked once
when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .engine.logprobs import TokenLogprob
from .engine.penalties import Penalties
from .engine.sampling import SamplingParams
from .engine.stats import Stats
from .errors import UsageError
from .options import (
    API_DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_P,
    DEFAULT_PENALTY_WINDOW,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    DRAFTERS,
    MAX_TREE,
    ConstraintSpec,
    check_choice,
    check_values,
)


@dataclass(frozen=True)
class GenerationRequest:
    """How to generate, for any prompt: the keyword arguments of ``SpecModel.generate`` and
    ``stream``, in one object the CLI, the server and the bench build. Its values are checked
    here, once, when it is built (UsageError); ``dataclasses.replace`` makes a variant."""

    # sampling
    max_tokens: int = API_DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    min_p: float = DEFAULT_MIN_P
    seed: int | None = None
    # penalties over the last penalty_window tokens of prompt + output (mlx-lm's processors):
    # repetition (multiplicative, 1 or None off), presence and frequency (additive, OpenAI's
    # meaning and range); logit_bias: token id -> added to its logit. All shape the
    # distribution the target samples from, so speculation stays exact under them.
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_window: int = DEFAULT_PENALTY_WINDOW
    logit_bias: dict[int, float] | None = None
    # logprobs: None off, 0 the chosen token's log-probability, n (<= 20) also the top n
    # alternatives (Chunk.logprobs / Result.logprobs); constraint: what the output must match
    # (JSON, a JSON schema, a regex, a grammar), enforced on every token, speculation on or off
    logprobs: int | None = None
    constraint: ConstraintSpec | None = None
    # speculation: the drafter; a fixed depth, or the adaptive depth's cap (None: per drafter);
    # gates switch speculation off where it does not pay
    drafter: str = "auto"
    depth: int | None = None
    max_depth: int | None = None
    gates: bool = True
    # draft trees: at most this many nodes a step, 0 none, None the cost model's choice,
    # "default" the drafter's own default (DFlash: the cost model's choice; others: none)
    tree: int | None | str = "default"
    # the prompt: a system prompt, text without the chat template (raw), the template's tools
    # (function schemas) and extra variables (e.g. enable_thinking)
    system: str | None = None
    raw: bool = False
    tools: list[dict] | None = None
    template_kwargs: dict | None = None
    # reuse: look the prompt up in the prefix cache and store this one there; checkpoints:
    # extra prompt positions to store at (None: where the conversation ends before the
    # generation prompt); the prompt is fed prefill_step tokens at a time, on_prefill(done,
    # total) follows it
    reuse: bool = True
    checkpoints: Sequence[int] | None = None
    prefill_step: int = 2048
    on_prefill: Callable[[int, int], None] | None = None
    # on_status(label): a slow step before the first token begins (measuring this machine's
    # verify cost, once per model); on_note(line): how the stored tune record changed the
    # drafter, or why it was not followed
    on_status: Callable[[str], None] | None = None
    on_note: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        check_choice("drafter", self.drafter, DRAFTERS)
        check_values({"max_tokens": self.max_tokens, "seed": self.seed})
        self.sampling.validate()
        check_values({"depth": self.depth, "logprobs": self.logprobs})
        check_values({"repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                      "frequency_penalty": self.frequency_penalty, "penalty_window": self.penalty_window,
                      "logit_bias": self.logit_bias})
        if self.tree not in (None, "default") and not (isinstance(self.tree, int) and 0 <= self.tree <= MAX_TREE):
            raise UsageError(f"tree must be a node count from 0 to {MAX_TREE}, or auto (got {self.tree!r})")
        if self.constraint is not None and not isinstance(self.constraint, ConstraintSpec):
            raise UsageError(f"constraint must be a ConstraintSpec, got {type(self.constraint).__name__}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.penalty_window,
                         tuple(sorted((self.logit_bias or {}).items())))


@dataclass
class Chunk:
    """What ``stream`` yields: the new text and tokens, and the running stats; with
    ``logprobs`` requested, one TokenLogprob per token of ``tokens`` (else None);
    ``drafted_chars``: how many leading characters of ``text`` came from accepted draft tokens."""

    text: str
    tokens: list[int]
    stats: Stats
    logprobs: list[TokenLogprob] | None = None
    drafted_chars: int = 0


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str | None = None
    prompt_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token, when requested

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "stats": self.stats.to_dict()}
