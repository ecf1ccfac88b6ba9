"""What a request's Ollama ``options`` mean here: the sampling options, penalties, seed,
``num_predict`` and ``stop`` it reads (with Ollama's defaults), the options accepted with no
effect (each group with why), the samplers accepted only at the value that turns them off, and
a 400 naming any other option: a typo or a sampler this server lacks is never silently dropped.
"""

from __future__ import annotations

import math

from ..options import MAX_SEED, OLLAMA_DEFAULTS, OLLAMA_REPEAT_LAST_N
from .common import APIError
from .contract import check_options, check_stop_strings, unknown_keys

# Ollama's penalties -> GenerationRequest's; off unless given (Ollama's own engine applies none
# by default either), over the last repeat_last_n tokens of prompt + output
PENALTIES = {"repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty"}
READ = {*OLLAMA_DEFAULTS, *PENALTIES, "repeat_last_n", "seed", "num_predict", "stop"}

# options accepted with no effect on what is generated
IGNORED = {
    # how Ollama loads and runs a model (context size, batch, GPU layers, threads, memory
    # mapping, context shifting): this server loaded its model once, at start, its own way
    "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
    "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
    "penalize_newline",  # deprecated: Ollama ignores it too
    "mirostat_tau", "mirostat_eta",  # mirostat's settings: it is off (below)
}
# samplers this server lacks: accepted at the value that leaves them off (clients send the
# defaults), a 400 otherwise
OFF_VALUES = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


def number(options: dict, key: str, integer: bool = False):
    """OPTIONS[KEY] (None: not given), a 400 naming it unless a number (an integer)."""
    value = options.get(key)
    if integer and isinstance(value, float) and value.is_integer():  # JSON numbers: 40.0 is 40 (as Ollama)
        value = int(value)
    kinds = (int,) if integer else (int, float)
    # an integer is finite however long (math.isfinite overflows past 1e308)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)
                              or isinstance(value, float) and not math.isfinite(value)):
        raise APIError(400, f"options.{key} must be {'an integer' if integer else 'a finite number'}",
                       param=f"options.{key}")
    return value


def check_known(options: dict) -> None:
    unknown_keys(options, READ | IGNORED | set(OFF_VALUES), "options")
    for key, off in OFF_VALUES.items():
        if key in options and number(options, key) != off:
            raise APIError(400, f"options.{key} is not supported by this server; leave it out or set it to {off:g}",
                           param=f"options.{key}")


def penalties(server, options: dict) -> dict:
    """GenerationRequest's penalty keywords from OPTIONS; repeat_last_n: Ollama's window, 0
    turns the penalties off and -1 makes it the model's context."""
    values = {ours: number(options, key) for key, ours in PENALTIES.items()}
    window = number(options, "repeat_last_n", integer=True)
    if window == 0:
        return {}
    if window == -1:
        window = server.prompts.context or OLLAMA_REPEAT_LAST_N
    if window is not None and window < -1:
        raise APIError(400, "options.repeat_last_n must be -1 (the context), 0 (off) or more",
                       param="options.repeat_last_n")
    values["penalty_window"] = window if window is not None else OLLAMA_REPEAT_LAST_N
    labels = {ours: f"options.{key}" for key, ours in PENALTIES.items()} | {"penalty_window": "options.repeat_last_n"}
    check_options("ollama", values, labels)
    return {k: v for k, v in values.items() if v is not None}


def sampling(server, options) -> tuple[dict, list[str]]:
    """GenerationRequest keywords (sampling, penalties and max_tokens) and stop strings from
    ``options``."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise APIError(400, "options must be an object", param="options")
    check_known(options)
    values = dict(OLLAMA_DEFAULTS)
    for key in OLLAMA_DEFAULTS:
        given = number(options, key, integer=key == "top_k")
        if given is not None:
            values[key] = given
    check_options("ollama", values, {key: f"options.{key}" for key in values})
    values |= penalties(server, options)
    seed = number(options, "seed", integer=True)
    if seed is not None and seed > MAX_SEED:
        raise APIError(400, f"options.seed must be at most {MAX_SEED}", param="options.seed")
    values["seed"] = seed if seed is not None and seed >= 0 else None  # Ollama's -1: a random seed
    n = number(options, "num_predict", integer=True)
    if n is None or n in (-1, -2):  # Ollama: until the model stops (-2: the context fills)
        n = server.settings.max_tokens_cap
    server.check_max_tokens(n, "options.num_predict")
    values["max_tokens"] = n
    stop = options.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or any(not isinstance(s, str) for s in stop)):
        raise APIError(400, "options.stop must be a string or a list of strings", param="options.stop")
    check_stop_strings(stop or [], "options.stop", empty_ok=True)
    return values, [s for s in stop or [] if s]
