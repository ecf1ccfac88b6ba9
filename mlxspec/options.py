"""Generation options every layer shares (CLI, config file, Python API, engine, server): their
names, limits and defaults, and the one check of their values.

No mlx import here: the CLI reads this module before any model is loaded, and starts fast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import MlxspecError, UsageError

# "assistant" is its own name, not "draft": Gemma 4's assistant is not a model of its own that
# --drafter draft could run (it reads the target's cache and hidden state), and a name users
# see in stats and `mlxspec tune` says which of the two drafted
DRAFTERS = ("auto", "pld", "draft", "mtp", "assistant", "dflash", "none")
# drafters that run a separate checkpoint (--draft-model): their tuned costs and depths belong
# to that checkpoint
MODEL_DRAFTERS = ("draft", "assistant", "dflash")
REASONING_MODES = ("on", "off", "auto")  # a thinking model's chat-template switch

# draft depth: tokens drafted per speculative step
MIN_DEPTH, MAX_DEPTH = 1, 16
# cap of the adaptive depth per drafter when none is asked for; the presets use the same caps
# (dflash: one block forward drafts any depth up to its block size - 1; the gate picks)
DEFAULT_MAX_DEPTH = {"pld": 8, "draft": 6, "mtp": 4, "assistant": 6, "dflash": 15}
FALLBACK_MAX_DEPTH = 4  # a drafter not listed above
MAX_TREE = 32  # nodes of the largest draft tree (--tree)

# sampling defaults: greedy, no filter
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_MIN_P = 0.0
# a temperature below this is greedy decoding: 1/temperature would scale the top token's
# log-probability (>= -13 for any vocabulary under 440k) past float16's range and sampling
# would draw from NaNs (5e-324 overflows every dtype); 1e-3 leaves a 5x margin
GREEDY_TEMPERATURE = 1e-3
# the other ends, where float32 (the sampler's dtype) breaks: a temperature of 1e308 becomes
# infinity and the logits NaN (one token drawn over and over), a top_p of 1e-300 becomes 0.
# The bound takes nothing from a user: at temperature 1e4 sampling is already uniform over the
# kept tokens to within 0.3% (logits spread < 30). A top_p below MIN_TOP_P (under 1 / any
# vocabulary: the top token alone is kept) is greedy decoding, as a vanishing temperature is
MAX_TEMPERATURE = 1e4
MIN_TOP_P = 1e-9
DEFAULT_MAX_TOKENS = 512  # one answer of `mlxspec run` (the config file's default too)
API_DEFAULT_MAX_TOKENS = 256  # SpecModel.generate / stream
MAX_SEED = 2**63 - 1  # the largest seed mx.random.seed takes

# seconds a run may spend measuring this machine's verify cost before its first answer (once per
# model, then stored): a slow machine measures fewer widths (`mlxspec tune` measures them all)
VERIFY_COST_BUDGET_S = 2.0
# ... and how it grows with the context, measured on the first request whose prompt and answer
# may reach CONTEXT_COST_FROM tokens (api_costs.py): forwards over caches padded to 4K and 16K
# tokens; a shorter request reads the curve as timed (`mlxspec tune` measures both, longer)
VERIFY_CONTEXT_BUDGET_S = 2.0
CONTEXT_COST_FROM = 2048

# earlier conversations' caches kept for prefix reuse (--prompt-cache-bytes)
DEFAULT_PROMPT_CACHE_SIZE = "2GiB"
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30  # DEFAULT_PROMPT_CACHE_SIZE in bytes

# the server
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 16  # requests that may wait for the worker before 503
DEFAULT_MAX_TOKENS_CAP = 4096  # largest max_tokens a request may ask for
# requests decoded together (--max-batch): the default fits this many rows of BATCH_ROW_CONTEXT
# tokens of KV cache into half the memory the weights leave, at most DEFAULT_MAX_BATCH_CAP
MAX_BATCH_LIMIT = 64
DEFAULT_MAX_BATCH_CAP = 8
BATCH_ROW_CONTEXT = 8192
# /v1/responses answers kept in memory for a later previous_response_id (least recently used
# dropped first; a conversation's turns share their messages, so a long chain costs one copy)
MAX_STORED_RESPONSES = 64
# arrays and objects in a request body nest at most this deep (a tool's JSON schema needs a
# dozen levels; Python's recursion limit, 1000, is far above)
MAX_JSON_DEPTH = 100
# stop strings a request may give, and their length in characters: each is matched against
# the new text of every chunk (OpenAI's surface keeps OpenAI's own count, 4)
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256
DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds running requests may finish in after SIGTERM, then cancelled
# what one client without a key may hold of the server (issue 33: 2,061 connections trickling
# header bytes used up 2,048 file handles; 150 unfinished 4 MiB bodies took 800 MB).
# Connections open at once (--max-connections): well under the common 1,024-2,048 file handle
# limit, which the model's files and the logs share; past it the oldest connection still
# waiting for its request's headers is closed, else the new one gets a 503
DEFAULT_MAX_CONNECTIONS = 256
# connections the kernel queues before they are accepted, and so the most asyncio accepts at
# once, before any is turned away: MAX_CONNECTIONS + twice this stays under the handle limit
# (uvicorn's 2,048 let one burst use up every handle)
ACCEPT_BACKLOG = 128
DEFAULT_MAX_BODY_BYTES = 4 << 20  # one request body; more is a 413
# request bodies buffered at once, all requests together (16 bodies at the largest): a body
# that would push the total past it is a 503 with Retry-After
DEFAULT_MAX_BUFFERED_BYTES = 64 << 20
HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers, then closed (408)
BODY_TIMEOUT = 30.0  # seconds a request may take to send its body (4 MiB at 140 KB/s), then 408
KEEP_ALIVE_TIMEOUT = 5  # seconds an idle kept-alive connection stays open (uvicorn's default)
MAX_HEADER_BYTES = 16 << 10  # a request line and headers (h11's default, named: larger is a 400)
# a JSON body at least this large is parsed and validated on a worker thread, in slices, so
# /health and running streams keep answering (a 4 MB body of small messages takes ~0.6 s)
PARSE_OFF_LOOP_BYTES = 256 << 10
# the same log line at most this many times per window; then counted, and the count logged
# (a full file handle table logged 487k accept errors in 50 s)
LOG_REPEATS, LOG_REPEAT_WINDOW = 5, 60.0
# the Ollama surface's sampling when a request's options leave it out: Ollama's own defaults,
# which its clients expect (the OpenAI surface's are OpenAI's)
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.0}
OLLAMA_REPEAT_LAST_N = 64  # Ollama's penalty window (repeat_last_n) when options leave it out

# penalties (mlx-lm's processors, mlx_lm.sample_utils.make_logits_processors): each counts the
# tokens among the last PENALTY_WINDOW of prompt + output, as mlx-lm's own server does
DEFAULT_PENALTY_WINDOW = 20
MAX_PENALTY_WINDOW = 1 << 24  # more than any context; a larger int overflows MLX's slicing
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one logit_bias value

# log-probabilities per generated token: None off, 0 the chosen token's, n also the top n
# alternatives (OpenAI's top_logprobs limit)
MAX_TOP_LOGPROBS = 20

# constrained output: what the answer must match (ConstraintSpec.kind -> what its value is)
CONSTRAINT_KINDS = {
    "json": "no value (any JSON object)",
    "json_schema": "a JSON schema object",
    "regex": "a regular expression string",
    "grammar": "a Lark grammar string",
}

# the command-line names of `mlxspec run`'s options (bench shares --temp): the first is the one
# messages use; the others are what mlx-lm (mlx_lm.generate) and llm users type
FLAGS = {
    "model": ("--model", "-m"),
    "temperature": ("--temp", "--temperature"),
    "max_tokens": ("--max-tokens", "-n"),
    "system": ("--system", "--system-prompt"),
    "raw": ("--raw", "--ignore-chat-template"),
    "json_schema": ("--json-schema",),
    "regex": ("--regex",),
}

# option: (whether a value is allowed, what it must be); the second reads after "must be"
LIMITS = {
    "drafter": (lambda v: v in DRAFTERS, "one of " + ", ".join(DRAFTERS)),
    "reasoning": (lambda v: v in REASONING_MODES, "one of " + ", ".join(REASONING_MODES)),
    "depth": (lambda v: MIN_DEPTH <= v <= MAX_DEPTH, f"between {MIN_DEPTH} and {MAX_DEPTH}"),
    "temperature": (lambda v: 0 <= v <= MAX_TEMPERATURE, f"between 0 and {MAX_TEMPERATURE:g}"),
    "top_p": (lambda v: 0 <= v <= 1, "between 0 and 1"),
    "top_k": (lambda v: v >= 0, "0 (off) or more"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "max_tokens": (lambda v: v >= 1, "at least 1"),
    "seed": (lambda v: 0 <= v <= MAX_SEED, f"between 0 and {MAX_SEED}"),  # what mx.random.key takes
    "logprobs": (lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"between 0 and {MAX_TOP_LOGPROBS}"),
    # 1 (or None) is off; > 1 makes a repeated token less likely (multiplicative, sign-aware)
    "repetition_penalty": (lambda v: 0 < v < math.inf, "more than 0 and finite (1 is off)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "between -2 and 2"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "between -2 and 2"),
    "penalty_window": (lambda v: 1 <= v <= MAX_PENALTY_WINDOW, f"between 1 and {MAX_PENALTY_WINDOW}"),
    "logit_bias": (lambda v: all(isinstance(t, int) and t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                                 for t, b in v.items()),
                   f"a map of token ids (0 or more) to biases between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"),
}


# the server's surfaces bound these options as the APIs they copy do, where that differs from
# LIMITS: a client written for OpenAI or Anthropic gets the 400 it would get there (Anthropic's
# temperature is 0 to 1, OpenAI's 0 to 2; Ollama bounds none itself). Every other option, and
# every option on a surface not named here, takes LIMITS' bounds.
SURFACE_LIMITS = {
    "openai": {"temperature": (lambda v: 0 <= v <= 2, "between 0 and 2")},
    "anthropic": {"temperature": (lambda v: 0 <= v <= 1, "between 0 and 1")},
    "ollama": {},
}


def limit_of(name: str, surface: str | None = None) -> tuple:
    """(whether a value is allowed, what it must be) for option NAME on SURFACE (None: the CLI,
    the config file and the Python API, which take LIMITS)."""
    return SURFACE_LIMITS.get(surface or "", {}).get(name) or LIMITS[name]


def check_values(values: Mapping[str, object], labels: Mapping[str, str] | None = None,
                 error: type[MlxspecError] = UsageError, surface: str | None = None) -> None:
    """Raise ERROR for the first of VALUES (option name -> value; None is not given) outside
    its limits (LIMITS, or SURFACE's where it sets its own), as "<label> must be <limit>, got
    <value>". A label is what the caller calls the option (a flag, a config key); it defaults
    to the option's name."""
    for name, value in values.items():
        allowed, limit = limit_of(name, surface)
        if value is not None and not allowed(value):
            label = (labels or {}).get(name, name)
            raise error(f"{label} must be {limit}, got {value!r}")


def check_choice(what: str, value, choices) -> None:
    """Refuse a name that is not one of CHOICES (drafters, reasoning modes, presets...)."""
    if value not in choices:
        raise UsageError(f"unknown {what} '{value}'; choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class ConstraintSpec:
    """What the generated text must match: ``kind`` is one of CONSTRAINT_KINDS ("json": any JSON
    object; "json_schema": VALUE is the schema dict; "regex": VALUE is a pattern; "grammar":
    VALUE is a Lark grammar). Checked when built (UsageError); compiled per request by the engine."""

    kind: str
    value: object = None

    def __post_init__(self) -> None:
        check_choice("constraint", self.kind, tuple(CONSTRAINT_KINDS))
        ok = {
            "json": self.value is None,
            "json_schema": isinstance(self.value, dict),
            "regex": isinstance(self.value, str) and self.value != "",
            "grammar": isinstance(self.value, str) and self.value.strip() != "",
        }[self.kind]
        if not ok:
            raise UsageError(f"a {self.kind} constraint takes {CONSTRAINT_KINDS[self.kind]}, "
                             f"got {type(self.value).__name__}")

# --bits of `bench`'s random-weight models (--sweep, --real-shapes); 0 is bf16
QUANT_BITS = (0, 2, 3, 4, 5, 6, 8)
