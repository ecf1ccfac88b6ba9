"""``mlxspec run``: one-shot generation, a prompt piped through stdin, or an interactive chat."""

import json
import os
import sys
from typing import Annotated, List, Optional

import typer

from ..config import user_config_path
from ..errors import UsageError
from ..options import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_P,
    DEFAULT_PENALTY_WINDOW,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    DRAFTERS,
    FLAGS,
    MAX_DEPTH,
    MAX_TREE,
    MIN_DEPTH,
    ConstraintSpec,
    check_choice,
    check_values,
)
from . import run_input
from .app import app
from .console import (
    check_reasoning,
    complete_drafter,
    complete_model,
    complete_reasoning,
    demo_notice,
    drafters_help,
    help_text,
    load_with_spinner,
    presets_help,
    print_note,
    print_stats,
    stderr_console,
    stdout_console,
    user_errors,
)

# what the flags are called in error messages
FLAG_LABELS = {"depth": "--depth", "temperature": FLAGS["temperature"][0], "top_p": "--top-p", "top_k": "--top-k",
               "min_p": "--min-p", "max_tokens": FLAGS["max_tokens"][0], "repetition_penalty": "--repetition-penalty",
               "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
               "penalty_window": "--penalty-window", "seed": "--seed"}
def _check_flags(given: dict, draft_model: Optional[str], depth: Optional[int]) -> None:
    """Refuse bad values (flags, $MLXSPEC_*, config) before anything is loaded."""
    check_choice("drafter", given["drafter"], DRAFTERS)
    if given["drafter"] == "draft" and not draft_model:
        raise UsageError("--drafter draft needs --draft-model PATH_OR_REPO")
    check_values({"depth": depth, "temperature": given["temp"], "top_p": given["top_p"], "top_k": given["top_k"],
                  "min_p": given["min_p"], "max_tokens": given["max_tokens"]}, FLAG_LABELS)
    check_reasoning(given["reasoning"])


def _unused_flags(given: dict, drafter: str, draft_model: Optional[str], depth: Optional[int],
                  seed: Optional[int]) -> Optional[str]:
    """A note for each flag that does nothing with the others given; the draft model returned
    (None when the drafter does not use it: it is not loaded)."""
    if seed is not None and given["temp"] == 0:
        print_note("note: --seed has no effect at temperature 0 (greedy decoding picks the same tokens anyway)")
    if depth is not None and drafter == "none":
        print_note("note: --depth has no effect with drafter none (nothing is drafted)")
    if draft_model is not None and drafter in ("pld", "mtp", "none"):
        print_note(f"note: --draft-model has no effect with drafter {drafter}: it is not loaded "
                   "(--drafter draft, assistant, dflash or auto uses it)")
        return None
    return draft_model


# -- the run command ---------------------------------------------------------

# paragraphs are unwrapped here: Typer's rich help keeps single newlines as line breaks
RUN_HELP = help_text("""
Generate text with MODEL, speculatively: the output is exactly what MODEL alone would write.

MODEL is a local folder or a Hugging Face repo id already in the local cache (or give it as
-m/--model: llama.cpp's -m, mlx-lm's --model; mlx-lm's own -m is its --max-tokens, -n here. A
second -m/--model, or a model argument beside it, is an error). Without it the default model is
used: $MLXSPEC_DEFAULT_MODEL, else default_model in {config}, else a small built-in demo model.
With a single argument, it is MODEL if it names a model (an existing folder or a cached repo
id), starts like a path (/, ./, ../, ~) or looks like a repo id (org/name); otherwise it is
PROMPT for the default model.

PROMPT "-" or no PROMPT reads the prompt from stdin when stdin is piped; a PROMPT and piped
stdin are joined: stdin's text, a blank line, then PROMPT. -p/--prompt PROMPT (as mlx-lm's) gives
the prompt as an option: the one argument left is then MODEL. Without PROMPT on a terminal an
interactive chat starts (/help lists its commands; a paste of many lines is one message, and
\"\"\" starts a multi-line message; Ctrl-C stops an answer, Ctrl-D quits).

A thinking model's reasoning (<think>...</think>) is shown dimmed before the answer on a
terminal and as written when piped; --hide-reasoning prints the answer only, --reasoning off
asks the model not to reason.
""").format(config=str(user_config_path()).replace(os.path.expanduser("~"), "~", 1))


def _default(text: str) -> str:
    """A default for --help, in Typer's own form (escaped: rich markup would eat the bracket)."""
    return f"\\[default: {text}]"


# each option's declaration, so that the command's signature reads as a list of names
ModelArgument = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, autocompletion=complete_model,
    help="Local model folder or cached Hugging Face repo id (default: the configured or demo model).")]
PromptArgument = Annotated[Optional[str], typer.Argument(
    metavar="PROMPT", show_default=False,
    help="The prompt; - reads stdin. Omit it to read stdin, or to chat on a terminal.")]
ModelOption = Annotated[Optional[List[str]], typer.Option(
    *FLAGS["model"], metavar="MODEL", show_default=False, autocompletion=complete_model,
    help="MODEL as an option (as mlx-lm's --model, llama.cpp's -m): the one argument left is then PROMPT. "
         "Given once: a second -m/--model, or a model argument beside it, is an error.")]
PromptOption = Annotated[Optional[str], typer.Option(
    "--prompt", "-p", metavar="PROMPT", show_default=False,
    help="PROMPT as an option (as mlx-lm's -p/--prompt); - reads stdin. The one argument left is then MODEL.")]
DrafterOption = Annotated[Optional[str], typer.Option(
    autocompletion=complete_drafter,
    help="How drafts are made: " + drafters_help() + " " + _default("auto, or $MLXSPEC_DRAFTER / config"),
    show_default=False)]
DraftModelOption = Annotated[Optional[str], typer.Option(
    "--draft-model", metavar="PATH_OR_REPO",
    help="What drafts tokens for MODEL: a small model sharing its tokenizer, a Gemma-4 assistant or a "
         "DFlash drafter made for it (told apart by its config.json). Also as llama.cpp's -md.")]
# --draft-model's and --depth's other names: apart, so that --help's columns of names stay narrow
# (their help names them)
DraftModelAliasOption = Annotated[Optional[str], typer.Option(
    "-md", metavar="PATH_OR_REPO", hidden=True, show_default=False)]
DepthOption = Annotated[Optional[int], typer.Option(
    "--depth", metavar="K",
    help=f"Tokens drafted per step, {MIN_DEPTH} to {MAX_DEPTH} (also as mlx-lm's --num-draft-tokens or llama.cpp's "
         "--draft-max). "
         + _default("adaptive, up to the depth `mlxspec tune` chose, else "
                    + ", ".join(f"{n} for {d}" for d, n in DEFAULT_MAX_DEPTH.items())),
    show_default=False)]
DepthAliasOption = Annotated[Optional[int], typer.Option(
    "--num-draft-tokens", "--draft-max", metavar="K", hidden=True, show_default=False)]
TreeOption = Annotated[Optional[str], typer.Option(
    metavar="N|auto",
    help=f"Draft trees: verify up to N candidate tokens a step in one forward (1 to {MAX_TREE} nodes), exact at "
         "any temperature; auto lets the measured verify cost decide; 0 drafts chains only. "
         + _default("auto for dflash, 0 for the other drafters"), show_default=False)]
PresetOption = Annotated[Optional[str], typer.Option(
    help="Speculation preset: " + presets_help(auto="chosen from the model and this machine; `mlxspec "
                                               "profile MODEL` shows the choice") + ". An explicit --drafter wins over "
         "the preset's drafter. " + _default("none, or $MLXSPEC_PRESET / config"), show_default=False)]
TempOption = Annotated[Optional[float], typer.Option(
    *FLAGS["temperature"],
    help="Sampling temperature; 0 is greedy. " + _default(f"{DEFAULT_TEMPERATURE}, or $MLXSPEC_TEMP / config"),
    show_default=False)]
TopPOption = Annotated[Optional[float], typer.Option(
    help="Nucleus sampling: keep the most likely tokens up to this probability mass, 1e-9 to 1. "
         + _default(f"{DEFAULT_TOP_P}, or $MLXSPEC_TOP_P / config"), show_default=False)]
TopKOption = Annotated[Optional[int], typer.Option(
    help="Keep only the K most likely tokens; 0 is off. " + _default(f"{DEFAULT_TOP_K}, or $MLXSPEC_TOP_K / config"),
    show_default=False)]
MinPOption = Annotated[Optional[float], typer.Option(
    help="Drop tokens less likely than MIN_P times the top token's probability; 0 is off. "
         + _default(f"{DEFAULT_MIN_P}, or $MLXSPEC_MIN_P / config"), show_default=False)]
RepetitionPenaltyOption = Annotated[Optional[float], typer.Option(
    help="Make tokens seen in the last --penalty-window tokens less likely (multiplicative, as mlx-lm's); "
         "1 is off. " + _default("off"), show_default=False)]
PresencePenaltyOption = Annotated[float, typer.Option(
    help="Subtract this from the logit of every token seen in the last --penalty-window tokens, -2 to 2 "
         "(OpenAI's presence_penalty).")]
FrequencyPenaltyOption = Annotated[float, typer.Option(
    help="Subtract this from a token's logit once per time it appears in the last --penalty-window tokens, "
         "-2 to 2 (OpenAI's frequency_penalty).")]
PenaltyWindowOption = Annotated[int, typer.Option(
    help="How many of the last tokens (prompt and answer) the penalties count. Speculation stays exact "
         "under every penalty.")]
SeedOption = Annotated[Optional[int], typer.Option(
    help="Random seed for reproducible sampling (temperature > 0). " + _default("none"), show_default=False)]
MaxTokensOption = Annotated[Optional[int], typer.Option(
    *FLAGS["max_tokens"],
    help="Most tokens to generate per answer. " + _default(f"{DEFAULT_MAX_TOKENS}, or $MLXSPEC_MAX_TOKENS / config"),
    show_default=False)]
SystemOption = Annotated[Optional[str], typer.Option(
    *FLAGS["system"], help="System prompt. " + _default("none"), show_default=False)]
RawOption = Annotated[bool, typer.Option(
    *FLAGS["raw"], help="Send the prompt as is, without the model's chat template.")]
ReasoningOption = Annotated[Optional[str], typer.Option(
    "--reasoning", metavar="on|off|auto", autocompletion=complete_reasoning,
    help="Whether a thinking model (Qwen3, Qwen3.5 ...) reasons before answering: sets the chat "
         "template's enable_thinking; auto keeps the template's default. "
         + _default("auto, or $MLXSPEC_REASONING / config"), show_default=False)]
HideReasoningOption = Annotated[bool, typer.Option(
    "--hide-reasoning", help="Print only the answer, not the <think> reasoning (shown dimmed on a "
                             "terminal, with its tags when piped).")]
JsonOption = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object {model, text, reasoning, finish_reason, tokens, stats} instead of "
                   "streaming text.")]
JsonSchemaOption = Annotated[Optional[str], typer.Option(
    *FLAGS["json_schema"], metavar="FILE", show_default=False,
    help="Constrain the answer to JSON that matches the JSON schema in FILE (speculation stays on).")]
RegexOption = Annotated[Optional[str], typer.Option(
    *FLAGS["regex"], metavar="PATTERN", show_default=False,
    help="Constrain the answer to text that matches the regular expression PATTERN.")]
NoStatsOption = Annotated[bool, typer.Option(
    "--no-stats", help="Do not show speed and acceptance statistics, nor the live status.")]
YesOption = Annotated[bool, typer.Option(
    "--yes", "-y", help="Download an aliased model (e.g. qwen3-8b) without asking.")]


@app.command(help=RUN_HELP, no_args_is_help=False)
def run(
    ctx: typer.Context,
    model: ModelArgument = None,
    prompt: PromptArgument = None,
    model_option: ModelOption = None,
    prompt_option: PromptOption = None,
    drafter: DrafterOption = None,
    draft_model: DraftModelOption = None,
    draft_model_alias: DraftModelAliasOption = None,
    depth: DepthOption = None,
    depth_alias: DepthAliasOption = None,
    tree: TreeOption = None,
    preset: PresetOption = None,
    temp: TempOption = None,
    top_p: TopPOption = None,
    top_k: TopKOption = None,
    min_p: MinPOption = None,
    seed: SeedOption = None,
    repetition_penalty: RepetitionPenaltyOption = None,
    presence_penalty: PresencePenaltyOption = 0.0,
    frequency_penalty: FrequencyPenaltyOption = 0.0,
    penalty_window: PenaltyWindowOption = DEFAULT_PENALTY_WINDOW,
    max_tokens: MaxTokensOption = None,
    system: SystemOption = None,
    raw: RawOption = False,
    reasoning: ReasoningOption = None,
    hide_reasoning: HideReasoningOption = False,
    json_out: JsonOption = False,
    json_schema: JsonSchemaOption = None,
    regex: RegexOption = None,
    no_stats: NoStatsOption = False,
    yes: YesOption = False,
) -> None:
    with user_errors():
        constraint = _constraint(json_schema, regex)
        from ..config import settings

        # unset flags come from $MLXSPEC_*, then the config file, then the defaults
        given = settings(dict(drafter=drafter, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                              max_tokens=max_tokens, preset=preset, reasoning=reasoning))
        depth = run_input.given_once("--depth", depth, depth_alias, "--num-draft-tokens or --draft-max")
        draft_model = run_input.given_once("--draft-model", draft_model, draft_model_alias, "-md")
        _check_flags(given, draft_model, depth)
        penalties = dict(repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                         frequency_penalty=frequency_penalty, penalty_window=penalty_window)
        check_values({**penalties, "seed": seed}, FLAG_LABELS)
        tree_nodes = parse_tree(tree)
        model, prompt = run_input.model_and_prompt(model_option, prompt_option, model, prompt)
        model, prompt = run_input.split_positionals(run_input.aliased_model(model, yes), prompt)
        prompt, system = run_input.argument_text(prompt, system)
        from .machine import prepare_run

        drafter, draft_model, preset_options = prepare_run(given["preset"], model, given["drafter"],
                                                           draft_model, ctx)
        draft_model = _unused_flags(given, drafter, draft_model, depth, seed)
        run_input.check_refs(model, draft_model)
        chat = prompt is None and sys.stdin is not None and sys.stdin.isatty()
        if chat and json_out:
            raise UsageError("--json needs a PROMPT argument or a prompt on stdin")
        prompt = run_input.prompt_text(prompt, chat)
        # each chat turn reuses the conversation so far (config prompt_cache_bytes)
        spec = _load(model, draft_model, given["prompt_cache_bytes"] if chat else None)
        from ..api import GenerationRequest
        from ..reasoning import template_kwargs

        request = GenerationRequest(
            max_tokens=given["max_tokens"], temperature=given["temp"], top_p=given["top_p"], top_k=given["top_k"],
            min_p=given["min_p"], seed=seed, drafter=drafter, depth=depth, tree=tree_nodes,
            system=system, raw=raw, **penalties,
            template_kwargs=template_kwargs(_reasoning(given["reasoning"], constraint, reasoning)),
            on_note=_once(print_note),
            # only a chat has a next turn: a one-shot run keeps no snapshot (memory)
            reuse=chat, constraint=constraint, **preset_options)
        _answer(spec, prompt, request, chat=chat, json_out=json_out, hide_reasoning=hide_reasoning,
                no_stats=no_stats)


def parse_tree(text: Optional[str]):
    """--tree's value as GenerationRequest.tree: "default" when not given, None for auto."""
    if text is None:
        return "default"
    if text.strip().lower() == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_TREE:
        raise UsageError(f"--tree must be auto or a node count from 0 to {MAX_TREE} (got {text!r})")
    return n


def _reasoning(mode: str, constraint: Optional[ConstraintSpec], flag: Optional[str]) -> str:
    """The reasoning mode: off with --json-schema / --regex (they hold from the answer's first
    token); --reasoning on with one is a usage error."""
    if constraint is None:
        return mode
    from ..reasoning import constrained_mode

    try:
        return constrained_mode(flag)
    except ValueError as e:
        raise UsageError(f"--reasoning on: {e}") from None


def _constraint(schema_file: Optional[str], regex: Optional[str]) -> Optional[ConstraintSpec]:
    """What --json-schema FILE or --regex PATTERN asks the answer to match (read and checked
    before the model loads); None: neither given."""
    schema_flag, regex_flag = FLAGS["json_schema"][0], FLAGS["regex"][0]
    if schema_file is not None and regex is not None:
        raise UsageError(f"give {schema_flag} or {regex_flag}, not both")
    if regex is not None:
        if not regex:
            raise UsageError(f"{regex_flag} must not be empty")
        return ConstraintSpec("regex", regex)
    if schema_file is None:
        return None
    try:
        with open(schema_file, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as err:
        raise UsageError(f"{schema_flag}: cannot read {schema_file}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{schema_flag}: {schema_file} is not JSON: {err}") from None
    if not isinstance(schema, dict):
        raise UsageError(f"{schema_flag}: {schema_file} must hold a JSON schema object")
    return ConstraintSpec("json_schema", schema)


def _once(show):
    """SHOW(line), each line once (a chat would repeat the same note every turn)."""
    shown = set()

    def show_once(line: str) -> None:
        if line not in shown:
            shown.add(line)
            show(line)

    return show_once


def _load(model: Optional[str], draft_model: Optional[str], prompt_cache_size: Optional[str]):
    """The loaded model; its prompt cache sized to PROMPT_CACHE_SIZE when given (a chat)."""
    cache_bytes = None
    if prompt_cache_size is not None:
        from ..config import parse_bytes

        cache_bytes = parse_bytes(prompt_cache_size, "prompt_cache_bytes")
    spec = load_with_spinner(model, draft_model, prompt_cache_bytes=cache_bytes)
    if spec.is_demo:
        demo_notice(spec.name)
    return spec


def _answer(spec, prompt, request, *, chat: bool, json_out: bool, hide_reasoning: bool, no_stats: bool) -> None:
    """One JSON object, the interactive chat, or one streamed answer and its stats; REQUEST is
    the :class:`~mlxspec.api.GenerationRequest` of every answer."""
    from . import chat as cli_chat

    live = not no_stats and stdout_console().is_terminal and stderr_console().is_terminal
    if json_out:
        from ..reasoning import split

        result = spec.generate(prompt, request=request)
        thought, text = split(result.text, cli_chat.starts_in_reasoning(spec, prompt, request))
        out = {"model": spec.name, **result.to_dict(), "text": text,
               "reasoning": None if hide_reasoning else thought or None, "finish_reason": result.finish_reason}
        sys.stdout.write(json.dumps(out) + "\n")
    elif chat:
        cli_chat.chat(spec, request, show_stats=not no_stats, live=live, hide_reasoning=hide_reasoning)
    else:
        answer = cli_chat.Answer(live, hide_reasoning).stream(spec, prompt, request)
        if not no_stats:
            print_stats(answer.stats, table=live)
        if answer.interrupted:
            raise typer.Exit(130)
