"""``mlxspec serve``: the OpenAI-, Anthropic- and Ollama-compatible server (mlxspec/server/)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from ..errors import MlxspecError, UsageError
from ..models.sharding import launch_rank
from ..options import (
    DEFAULT_HOST,
    DEFAULT_MAX_BATCH_CAP,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS_CAP,
    DEFAULT_PORT,
    DEFAULT_PROMPT_CACHE_SIZE,
    MAX_BATCH_LIMIT,
)
from .app import app
from .console import (
    check_reasoning,
    complete_drafter,
    complete_model,
    complete_reasoning,
    demo_notice,
    drafters_help,
    help_text,
    model_errors,
    no_color,
    presets_help,
    print_error,
    print_note,
    quiet_libraries,
    user_errors,
)
from .run_input import model_option

SERVE_HELP = """Serve MODEL over HTTP with OpenAI-, Anthropic- and Ollama-compatible endpoints.

Endpoints: POST /v1/chat/completions, /v1/completions (OpenAI; streaming or not, tools),
POST /v1/messages, /v1/messages/count_tokens (Anthropic), POST /api/chat, /api/generate,
/api/show, GET /api/tags, /api/ps, /api/version (Ollama), GET /v1/models, /health, /metrics
(Prometheus), and the OpenAPI schema at /openapi.json (docs at /docs). Every request is
speculated (per-request override: "speculation": {"drafter": "pld", "depth": 2, "tree": 8,
"enabled": false}) and its drafted/accepted counts come back in usage. One generation runs at
a time; up to --max-queue more wait, then 503 with Retry-After.

Conversations are reused: a request whose prompt starts like an earlier one's (the same chat,
one turn later) prefills only the new part, with exactly the same output; up to
--prompt-cache-bytes of caches are kept, least recently used first out. usage reports the
reused tokens (OpenAI prompt_tokens_details.cached_tokens, Anthropic cache_read_input_tokens).

A thinking model's <think> reasoning comes back apart from the answer: OpenAI
"reasoning_content", Anthropic thinking blocks. Whether it reasons is --reasoning's default,
or per request "reasoning" ("off", {"enabled": false}), "reasoning_effort" ("none" is off) or
"chat_template_kwargs" ({"enable_thinking": false}); Anthropic: "thinking" ({"type":
"disabled"}).

Binding to anything but loopback needs an API key (--api-key, --api-key-file or
MLXSPEC_API_KEY), given by clients as `Authorization: Bearer KEY` or `x-api-key: KEY`.

A browser opening / gets a chat page over the OpenAI endpoint: streaming, tok/s and acceptance
live, text from accepted draft tokens marked, a stop button (it asks for the API key when one is
set). On by default on loopback, off elsewhere unless --ui; --no-ui turns it off.

Under mlx.launch (a model sharded over several processes or machines, docs/distributed.md)
rank 0 serves and the other ranks run each of its generations with it; requests run one at a
time (--max-batch 1)."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _api_key(key: Optional[str], key_file: Optional[str]) -> Optional[str]:
    if key and key_file:
        raise UsageError("give --api-key or --api-key-file, not both")
    if key_file:
        try:
            key = Path(key_file).expanduser().read_text(encoding="utf-8").strip()
        except OSError as err:
            raise UsageError(f"cannot read --api-key-file {key_file}: {err.strerror}") from None
        if not key:
            raise UsageError(f"--api-key-file {key_file} is empty")
    return key or os.environ.get("MLXSPEC_API_KEY") or None


@app.command(help=help_text(SERVE_HELP))
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", show_default=False, autocompletion=complete_model,
        help="Model folder or cached repo id (default: the configured default, else the demo model).")] = None,
    model_option: Annotated[Optional[List[str]], typer.Option(
        "--model", "-m", metavar="MODEL", show_default=False, autocompletion=complete_model,
        help="MODEL as an option, as `run` takes it (given once: a second one, or a MODEL argument "
             "beside it, is an error).")] = None,
    draft_model: Annotated[Optional[str], typer.Option(
        "--draft-model", metavar="M", show_default=False,
        help="Draft model with the same tokenizer, Gemma-4 assistant or DFlash drafter made for MODEL.")] = None,
    drafter: Annotated[Optional[str], typer.Option(
        "--drafter", metavar="NAME", show_default=False, autocompletion=complete_drafter,
        help="Default drafter: " + drafters_help() + " (default: config, else auto).")] = None,
    preset: Annotated[Optional[str], typer.Option(
        "--preset", metavar="P", show_default=False,
        help=presets_help() + ": as `run --preset` (an explicit --drafter wins).")] = None,
    host: Annotated[Optional[str], typer.Option(
        "--host", show_default=False, help=f"Address to bind (default: config, else {DEFAULT_HOST}).")] = None,
    port: Annotated[Optional[int], typer.Option(
        "--port", show_default=False, help=f"Port to bind (default: config, else {DEFAULT_PORT}).")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", metavar="KEY", show_default=False, help="Require this key on every /v1 and /api request.")] = None,
    api_key_file: Annotated[Optional[str], typer.Option(
        "--api-key-file", metavar="F", show_default=False, help="Read the key from file F.")] = None,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", metavar="N", help="Requests that may wait for the worker before 503.")] = DEFAULT_MAX_QUEUE,
    max_batch: Annotated[Optional[int], typer.Option(
        "--max-batch", metavar="N", show_default=False,
        help="Requests decoded together, each exact as if alone (the Gemma-4 assistant and draft "
             "trees run one at a time; DFlash drafts chains). Default: what this machine's memory holds beside "
             f"the model, at most {DEFAULT_MAX_BATCH_CAP}; 1 serves one at a time (always under mlx.launch).")] = None,
    max_tokens_cap: Annotated[int, typer.Option(
        "--max-tokens-cap", metavar="N", help="Largest max_tokens a request may ask for.")] = DEFAULT_MAX_TOKENS_CAP,
    max_connections: Annotated[int, typer.Option(
        "--max-connections", metavar="N",
        help="Connections open at once; past it the one that has waited longest for its request's "
             "headers is closed, else the new one gets a 503. Keep it well under the file handle "
             "limit (ulimit -n).")] = DEFAULT_MAX_CONNECTIONS,
    prompt_cache_bytes: Annotated[Optional[str], typer.Option(
        "--prompt-cache-bytes", metavar="SIZE", show_default=False,
        help="Memory for earlier conversations' caches (e.g. 4GiB, 512MB; 0 turns reuse off): a "
             "request sharing a prefix with one prefills only the rest. Least recently used "
             f"conversations go first. Default: config, else {DEFAULT_PROMPT_CACHE_SIZE}.")] = None,
    reasoning: Annotated[Optional[str], typer.Option(
        "--reasoning", metavar="MODE", show_default=False, autocompletion=complete_reasoning,
        help="Default reasoning of thinking models: on, off or auto (the chat template's default); "
             "requests override it (default: $MLXSPEC_REASONING, config, else auto).")] = None,
    cors: Annotated[bool, typer.Option("--cors", help="Allow cross-origin requests from any origin.")] = False,
    ui: Annotated[Optional[bool], typer.Option(
        "--ui/--no-ui", show_default=False,
        help="The chat page at / (a browser's request; default: on when bound to loopback, off "
             "otherwise).")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
) -> None:
    with user_errors():
        from ..config import settings

        # unset flags come from $MLXSPEC_*, then the config file ([server], drafter, preset)
        given = settings(dict(drafter=drafter, host=host, port=port, preset=preset, reasoning=reasoning,
                              prompt_cache_bytes=prompt_cache_bytes))
        host, port = given["host"], given["port"]
        cache_bytes, key = _check_flags(given, max_queue, max_tokens_cap, api_key, api_key_file,
                                        max_connections, max_batch)
        model = _one_model(model, model_option)
        ui_on = _is_loopback(host) if ui is None else ui
        follower = _follower_or_port_free(host, port)
        from .machine import prepare_run
        drafter, draft_model, _ = prepare_run(given["preset"], model, given["drafter"], draft_model, ctx)
        if follower:
            return _follow(_load(model, draft_model, cache_bytes))
        spec, application = _build_app(model, draft_model, cache_bytes, max_connections, max_batch, api_key=key,
                                       max_queue=max_queue, max_tokens_cap=max_tokens_cap, drafter=drafter,
                                       cors=cors, reasoning=given["reasoning"], ui=ui_on)
    _banner(spec, application.state.batch_note, host, port, key, drafter, ui_on)
    _run_server(application, host, port, log_level)


def _banner(spec, batch_note: str, host: str, port: int, key: Optional[str], drafter: str, ui_on: bool) -> None:
    """What is served where, a request to try, how requests are batched, the chat page."""
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    auth = f" -H 'Authorization: Bearer {'$MLXSPEC_API_KEY' if key else ''}'" if key else ""
    print_note(f"mlxspec serving {spec.name} at {url} (drafter {drafter}"
               f"{', draft ' + spec.draft.name if spec.draft else ''})")
    body = f'{{"model": "{spec.name}", "messages": [{{"role": "user", "content": "Hello"}}]}}'
    print_note(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    print_note(batch_note)
    if ui_on:
        print_note(f"chat page: open {url}/ in a browser")


def _check_flags(given: dict, max_queue: int, max_tokens_cap: int, api_key: Optional[str], api_key_file: Optional[str],
                 max_connections: int, max_batch: Optional[int]) -> tuple[int, Optional[str]]:
    """Refuse bad settings before the model loads -> (prompt cache bytes, API key or None)."""
    check_reasoning(given["reasoning"])
    if not 1 <= given["port"] <= 65535:  # $MLXSPEC_PORT's and the config file's are checked where read
        raise UsageError(f"--port must be between 1 and 65535, got {given['port']}")
    if max_connections < 1:
        raise UsageError("--max-connections must be >= 1")
    if max_batch is not None and not 1 <= max_batch <= MAX_BATCH_LIMIT:
        raise UsageError(f"--max-batch must be from 1 to {MAX_BATCH_LIMIT} (got {max_batch})")
    from ..config import parse_bytes

    cache_bytes = parse_bytes(given["prompt_cache_bytes"], "--prompt-cache-bytes")
    if max_queue < 0 or max_tokens_cap < 1:
        raise UsageError("--max-queue must be >= 0 and --max-tokens-cap >= 1")
    key = _api_key(api_key, api_key_file)
    if not _is_loopback(given["host"]) and not key:
        raise UsageError(f"refusing to bind {given['host']} (not loopback) without an API key: "
                         "pass --api-key, --api-key-file or set MLXSPEC_API_KEY")
    return cache_bytes, key


def _one_model(argument: Optional[str], options: Optional[List[str]]) -> Optional[str]:
    """The model, from the MODEL argument or -m/--model (as `run` takes it): given once."""
    option = model_option(options)
    if option is not None and argument is not None:
        raise UsageError(f"MODEL given twice: -m/--model {option!r} and the argument {argument!r}; give it once")
    return option if option is not None else argument


class PortUnavailable(MlxspecError):
    """The port `serve` was given is in use, or not this user's to bind."""


def check_port_free(host: str, port: int) -> None:
    """Bind HOST:PORT and let it go, as uvicorn will bind it: a port in use, or one this user may
    not bind, is a one-line error now rather than after the model has loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is free
            probe.bind(address)
    except socket.gaierror as err:
        raise PortUnavailable(f"cannot bind {host}:{port}: {err.strerror}") from None
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise PortUnavailable(f"port {port} on {host} is in use; pick another with --port") from None
        raise PortUnavailable(f"cannot bind {host}:{port}: {err.strerror}") from None


def _build_app(model: Optional[str], draft_model: Optional[str], cache_bytes: int, max_connections: int,
               max_batch: Optional[int], **settings):
    """The loaded model and the ASGI app serving it; SETTINGS are the server's Settings
    (max_batch: None chooses it; ``app.state.batch_note`` says what was chosen and why)."""
    from ..server.app import create_app
    from ..server.common import Settings
    from ..server.limits import Limits

    spec = _load(model, draft_model, cache_bytes)
    if spec.is_demo:
        demo_notice(spec.name)
    max_batch, note = _max_batch(spec, max_batch)
    app = create_app(spec, Settings(model_name=spec.name, max_batch=max_batch, **settings),
                     Limits(max_connections=max_connections))
    app.state.batch_note = note
    return spec, app


def _follower_or_port_free(host: str, port: int) -> bool:
    """Whether this process is a rank > 0 of mlx.launch (it runs rank 0's generations and serves
    nothing); otherwise HOST:PORT is checked now, before the model loads (minutes, for a port in use)."""
    if launch_rank():
        return True
    check_port_free(host, port)
    return False


def _load(model: Optional[str], draft_model: Optional[str], cache_bytes: int):
    from ..api import load

    quiet_libraries()
    with model_errors(model, draft_model):
        return load(model, draft_model=draft_model, prompt_cache_bytes=cache_bytes)


def _follow(spec) -> None:
    """A rank > 0 of a sharded serve: every generation rank 0 runs, until its server stops."""
    from ..server.sharded import follow

    follow(spec, spec.target.group)
    _end_sharded_process()


def _end_sharded_process() -> None:
    """Exit 0 now that every rank has stopped serving, without the interpreter's teardown: there
    MLX's C++ state (the ring backend's threads) is destroyed while a Python thread may still
    collect garbage, which aborted rank 0 in 2 exits of 32 ("terminate called without an active
    exception", SIGABRT; none in 60 since), and mlx.launch reports such a rank as failed."""
    from ..engine.watchdog import exit_now

    exit_now(0)


def _max_batch(spec, asked: Optional[int]) -> tuple[int, str]:
    """The requests decoded together, and the banner's line about it."""
    group = getattr(getattr(spec, "target", None), "group", None)
    if group is not None:  # every rank runs each generation with rank 0: one at a time
        ignored = f"; --max-batch {asked} does not apply" if asked is not None and asked > 1 else ""
        return 1, (f"requests run one at a time: the model is sharded over {group.size()} processes "
                   f"(mlx.launch){ignored}")
    if spec.cannot_batch:
        return 1, f"requests run one at a time: {spec.name} cannot batch ({spec.cannot_batch})"
    if asked is None:
        from ..engine.batch_cache import kv_bytes_per_token
        from ..engine.cache import model_nbytes
        from ..hardware import detect
        from ..presets import default_max_batch

        asked, why = default_max_batch(detect(fast=True).memory_budget_bytes, model_nbytes(spec.target.model),
                                       kv_bytes_per_token(spec.target.model))
        how = f"default: {why}; --max-batch sets it"
    else:
        how = "--max-batch"
    if asked == 1:
        return 1, f"requests run one at a time ({how})"
    return asked, (f"up to {asked} requests decode together ({how}); requests with the Gemma-4 "
                   "assistant or draft trees run alone (DFlash drafts chains)")


def _run_server(application, host: str, port: int, log_level: str) -> None:
    """uvicorn until Ctrl-C or SIGTERM (running requests get a bounded time to finish, a second
    signal stops at once), with one log line per request."""
    import logging

    from ..server.lifecycle import serve as serve_app

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    request_log = logging.getLogger("mlxspec.server")
    request_log.addHandler(handler)  # one line per request: tokens, finish, drafted/accepted
    request_log.setLevel(logging.INFO)
    try:
        serve_app(application, host, port, log_level=log_level, use_colors=False if no_color() else None)
    except OSError as err:
        print_error(f"cannot bind {host}:{port}: {err.strerror}")
        raise typer.Exit(1) from None
    finally:  # a sharded target's other ranks stop with it
        application.state.server.close()
    if application.state.server.group is not None:
        _end_sharded_process()
