"""The ``mlxspec bench`` command; it registers on the one Typer app of :mod:`mlxspec.cli`."""

import sys
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from ..options import DRAFTERS, FLAGS, MAX_DEPTH, MIN_DEPTH, check_values
from .app import app
from .bench_concurrency import run_concurrency, run_real_concurrency_cli
from .bench_options import (
    DEFAULT_DRAFT,
    DEFAULT_MODEL,
    BitsOption,
    ChatContextOption,
    ChatOption,
    ChatShapesOption,
    ChatTurnsOption,
    ChatUserTokensOption,
    ConcurrencyOption,
    DepthOption,
    DepthsOption,
    DraftDepthOption,
    DrafterOption,
    DraftModelOption,
    DtypeOption,
    EnginesOption,
    FromJsonOption,
    GatesOption,
    JoinTokensOption,
    JsonPathOption,
    KernelsOffOption,
    MaxTokensOption,
    ModelArgument,
    PngPathOption,
    PromptsOption,
    PromptTokensOption,
    RealShapesOption,
    RepsOption,
    SeedOption,
    ShardedOption,
    SweepContextOption,
    SweepOption,
    SweepTokensOption,
    TemperatureOption,
    TempPassOption,
    WorkloadsDirOption,
    WorkloadsOption,
    check_bits,
)
from .bench_sharded import run_sharded_cli
from .console import (
    help_text,
    load_with_spinner,
    print_note,
    progress,
    stdout_console,
    user_errors,
)


def builtin_workloads(package: Path = Path(__file__).resolve().parents[1]) -> Path:
    """The built-in prompt sets: one copy, benchmarks/workloads, installed as mlxspec/bench/workloads."""
    installed = package / "bench" / "workloads"
    return installed if installed.is_dir() else package.parent / "benchmarks" / "workloads"


DTYPES = ("float32", "bfloat16", "float16")  # what --dtype casts the loaded models to

BENCH_HELP = help_text("""
Benchmark mlx-lm against mlxspec's drafters on prompt sets, all in one process; or, with
--sweep, time a forward of 1..N tokens on random-weight models of real shapes; or, with
--chat, time the first token of each turn of a growing chat with and without prefix reuse.

Engines: mlx-lm (mlx_lm.stream_generate, plain decoding: the baseline, always run), mlx-lm-draft
(mlx-lm's own speculation with --draft-model; dense targets only, since mlx-lm cannot roll back
linear-attention layers), and mlxspec-none, -pld, -draft (needs --draft-model), -mtp (needs an
MTP head in MODEL) and -auto. An engine that cannot run with these models is skipped, with why.

A workload is WORKLOADS_DIR/NAME.jsonl, one {"id", "prompt", "max_tokens"} object per line (the built-in sets, echo,
completion, novel, toolcall, are cut from held-out source files); prompts are raw text (no chat template), tokenized
once and given as the same token ids to every engine. --workloads fim (never a default): fill-in-the-middle on
--prompts spans (default 8) of 3-12 lines of mlxspec's own source (seeded), in the model's FIM layout as /infill builds
it (prefix + suffix: 1500 tokens at most), max_tokens the span's; also a table per span. After one warm-up run of each
engine, the engines run interleaved: for each repetition, each prompt, each engine. Reported per workload and engine,
median over the repetitions: decode tok/s (tokens after the first / time from the first to the last token), speedup
over mlx-lm, acceptance and tokens per verify (mlx-lm-draft: from its from_draft flags; its acceptance is not
observable), the share of tokens from drafts, time to first token (cold for every engine: the whole prompt prefilled,
mlxspec's prefix cache not used), peak memory (MLX's, all loaded weights included) and whether the tokens are identical
to mlx-lm's at temperature 0. A second pass at --temp (seeded per prompt, the same seed for every engine) measures the
speculative engines under sampling. Progress (engine, repetition, tokens so far) goes to stderr, tables to stdout.

--chat: a conversation of token ids (no tokenizer, no template) on MODEL, or on random-weight models of --chat-shapes:
user blocks of pseudo-random ids (fixed seed) and the model's own greedy answers of --max-tokens tokens (default 64
here); turn 1's block is sized so that the last turn's prompt is --chat-context tokens. Each turn runs three ways,
after an untimed warm-up: the engine (--drafter) with no prefix cache, the engine with the conversation's prefix cache
(fed by the earlier turns, as a server's is), and mlx-lm's generate_step. Reported per turn, median over --reps
conversations (each with a fresh cache): prompt and cached tokens, time to first token of each, the speedup of reuse,
and whether the tokens are identical.

--real-shapes: the engines on random-weight models of real shapes (quantized to --bits), whose
target logits are replaced after each real forward by a scripted continuation, so the output
is known in advance and checked token for token. Workloads (--workloads): echo (spans of the
prompt with an edit every ~25 tokens), novel (tokens absent from the prompt), scripted-aA (the
drafters' proposals right with probability A), dflash / mtp-like (right by draft position: a DFlash drafter of the
published size as chains of depth 3/7/15 and trees of 4-32 nodes; the MTP head). Engines: stock mlx-lm (a process of
its own, proven free of mlxspec's kernels) plain and with a draft model (dense only), mlx-lm + mlxspec kernels, mlxspec
none / pld / mtp (a random head) / draft (Qwen3-0.6B-shaped) / assistant (Gemma-4) / dflash, gated, and forced depths.
Reps run ABAB. Per cell: tok/s, paired speedup over stock mlx-lm (median, IQR), ideal, ach/ideal, accept, tok/step.

--from-json redraws the tables (and --png) from saved results without running anything.
""")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def _outputs(docs, json_path, png_path) -> None:
    from ..bench.report import render, write_chart, write_json

    for doc in docs:
        render(doc, stdout_console())
    if json_path:
        write_json(docs[0], json_path)
        print_note(f"wrote {json_path}")
    if png_path:
        write_chart(docs, png_path)
        print_note(f"wrote {png_path}")


@app.command(help=BENCH_HELP)
def bench(
    model: ModelArgument = None,
    draft_model: DraftModelOption = None,
    workloads_dir: WorkloadsDirOption = None,
    workloads: WorkloadsOption = None,
    prompts: PromptsOption = None,
    max_tokens: MaxTokensOption = None,
    engines: EnginesOption = None,
    reps: RepsOption = None,
    draft_depth: DraftDepthOption = 3,
    depth: DepthOption = None,
    gates: GatesOption = True,
    temperature: TemperatureOption = 0.7,
    temp_pass: TempPassOption = True,
    seed: SeedOption = 0,
    json_path: JsonPathOption = None,
    png_path: PngPathOption = None,
    from_json: FromJsonOption = None,
    sweep: SweepOption = None,
    bits: BitsOption = 4,
    sweep_tokens: SweepTokensOption = 16,
    dtype: DtypeOption = None,
    sweep_context: SweepContextOption = 256,
    chat: ChatOption = False,
    chat_shapes: ChatShapesOption = None,
    chat_turns: ChatTurnsOption = None,
    chat_context: ChatContextOption = None,
    chat_user_tokens: ChatUserTokensOption = None,
    drafter: DrafterOption = None,
    real_shapes: RealShapesOption = None,
    prompt_tokens: PromptTokensOption = 512,
    depths: DepthsOption = "1,2,3,4,5,6,7,8",
    kernels_off: KernelsOffOption = False,
    concurrency: ConcurrencyOption = None,
    join_tokens: JoinTokensOption = None,
    sharded: ShardedOption = False,
) -> None:
    with user_errors():
        if from_json:
            _check(json_path is None and sweep is None and model is None and not chat,
                   "--from-json only redraws saved results: give no MODEL, --sweep, --chat or --json")
            _redraw(from_json, png_path)
            return
        _check_counts(reps=reps, draft_depth=draft_depth, depth=depth, temperature=temperature, prompts=prompts,
                      max_tokens=max_tokens, seed=seed)
        _check_early(png_path, engines, chat or sharded or (sweep, concurrency, join_tokens) != (None, None, None))
        if concurrency is not None or join_tokens is not None:
            _check(not chat and sweep is None, "--concurrency is a benchmark of its own: give no --chat or --sweep")
            return _run_concurrency(model, draft_model, dtype, concurrency, join_tokens, real_shapes, bits=bits,
                                    workloads_dir=workloads_dir, workloads=workloads, prompts=prompts,
                                    max_tokens=max_tokens, reps=reps, drafter=drafter, temperature=temperature,
                                    seed=seed, prompt_tokens=prompt_tokens, json_path=json_path)
        chat_flags = {"--chat-shapes": chat_shapes, "--chat-turns": chat_turns, "--chat-context": chat_context,
                      "--chat-user-tokens": chat_user_tokens, "--drafter": drafter}
        given = [flag for flag, value in chat_flags.items() if value is not None]
        _check(chat or not given, f"{given[0] if given else ''} needs --chat")
        outputs = (json_path, png_path)
        if chat:
            _check(sweep is None, "--chat and --sweep are two benchmarks: give one")
            _run_chat(model, draft_model, chat_shapes, chat_turns, chat_context, chat_user_tokens,
                      drafter, max_tokens, reps, bits, dtype, *outputs)
        elif sharded:  # --real-shapes over the ranks of an mlx.launch run
            run_sharded_cli(real_shapes, (model, draft_model, sweep), bits=bits, workloads=workloads, seed=seed,
                            prompt_tokens=prompt_tokens, max_tokens=max_tokens, reps=reps, outputs=outputs)
        elif real_shapes is not None:
            _check(sweep is None and model is None and draft_model is None,
                   "--real-shapes builds its own random models: give no MODEL, --draft-model or --sweep")
            _run_real_shapes(real_shapes, bits=bits, workloads=workloads, engines=engines, depths=depths,
                             prompt_tokens=prompt_tokens, max_tokens=max_tokens or 128, reps=reps or 8, seed=seed,
                             temperature=temperature if temp_pass else None, outputs=outputs)
        elif sweep is not None:
            _check(model is None and draft_model is None,
                   "--sweep builds its own random models: give no MODEL or --draft-model")
            _run_sweep(sweep, bits=bits, kernels_off=kernels_off, tokens=sweep_tokens, context=sweep_context,
                       reps=reps or 5, outputs=outputs)
        else:
            _run_engines(model, draft_model, dtype, workloads_dir=workloads_dir, workloads=workloads,
                         prompts=prompts, max_tokens=max_tokens, engines=engines, draft_depth=draft_depth,
                         depth=depth, reps=reps, temperature=temperature, temp_pass=temp_pass, seed=seed,
                         gates=gates, outputs=outputs)


def _run_concurrency(model, draft_model, dtype, concurrency, join_tokens, real_shapes, *, bits, workloads_dir,
                     workloads, prompts, max_tokens, reps, drafter, temperature, seed, prompt_tokens,
                     json_path) -> None:
    """``bench --concurrency``: on MODEL, or with --real-shapes on a scripted random model."""
    _check(concurrency is not None and (join_tokens is None or join_tokens >= 1),
           "--join-tokens needs --concurrency and a count of at least 1")
    if real_shapes is not None:
        _check(model is None and draft_model is None,
               "--real-shapes builds its own random models: give no MODEL or --draft-model")
        check_bits(bits)
        return run_real_concurrency_cli(real_shapes, concurrency, bits=bits, workloads=workloads,
                                        prompt_tokens=prompt_tokens, max_tokens=max_tokens or 128, reps=reps or 8,
                                        seed=seed, join_tokens=join_tokens, json_path=json_path, progress=progress)
    return run_concurrency(model, draft_model, dtype, concurrency, workloads_dir or builtin_workloads(), workloads,
                           prompts, max_tokens, reps, drafter, temperature, seed, json_path, progress, join_tokens)


def _check_counts(*, reps, draft_depth, depth, temperature, prompts, max_tokens, seed) -> None:
    """The flags every benchmark shares, checked before anything is built or loaded."""
    _check(reps is None or reps >= 1, f"--reps must be at least 1, got {reps}")
    check_values({"depth": draft_depth}, {"depth": "--draft-depth"})
    check_values({"depth": depth, "temperature": temperature},
                 {"depth": "--depth", "temperature": FLAGS["temperature"][0]})
    _check(prompts is None or prompts >= 1, f"--prompts must be at least 1, got {prompts}")
    check_values({"max_tokens": max_tokens, "seed": seed}, {"max_tokens": "--max-tokens", "seed": "--seed"})


def _check_early(png_path: Optional[str], engines: Optional[str], own_engines: bool) -> None:
    """Before minutes of measuring, not after: the chart can be drawn, and --engines is not
    given to a benchmark that runs engines of its own (OWN_ENGINES: --chat, --sweep,
    --concurrency, --sharded), where it would be ignored."""
    _check(engines is None or not own_engines, "--engines picks the engines of the prompt sets or of --real-shapes; "
           "--chat, --sweep, --concurrency and --sharded run engines of their own")
    if png_path:
        from ..bench.report import check_matplotlib

        check_matplotlib()


def _check_dtype(dtype: Optional[str]) -> None:
    _check(dtype is None or dtype in DTYPES, f"--dtype must be float32, bfloat16 or float16; got {dtype}")


def _redraw(paths: list[str], png_path: Optional[str]) -> None:
    """``--from-json``: the tables (and chart) of saved results, nothing run."""
    from ..bench.report import check_matplotlib, read_json

    docs = [read_json(path) for path in paths]
    if png_path:
        check_matplotlib()
    _outputs(docs, None, png_path)


def _run_real_shapes(names: str, *, bits, workloads, engines, depths, prompt_tokens, max_tokens, reps, seed,
                     temperature, outputs) -> None:
    """``bench --real-shapes``: the engines on scripted random-weight models."""
    check_bits(bits)
    from ..bench.prompts import parse_list
    from ..bench.real_plan import parse_engines
    from ..bench.real_shapes import WORKLOADS, parse_shapes, run_real_shapes
    from ..bench.report import real_shapes_document, write_json

    shapes = parse_shapes(names)
    only = parse_engines(engines)
    chosen = parse_list(workloads, "workloads") or list(WORKLOADS)
    given = parse_list(depths, "depths")
    _check(all(d.isdigit() and MIN_DEPTH <= int(d) <= MAX_DEPTH for d in given),
           f"--depths must be numbers from {MIN_DEPTH} to {MAX_DEPTH}, got {depths}")
    json_path, png_path = outputs

    def save_partial(result):  # the repetitions done survive a run stopped later
        if json_path:
            write_json(real_shapes_document(result), json_path)

    with progress("real shapes") as on_step:
        result = run_real_shapes(shapes, bits=bits, prompt_tokens=prompt_tokens, max_tokens=max_tokens, reps=reps,
                                 workloads=chosen, depths=tuple(int(d) for d in given), seed=seed,
                                 temperature=temperature, on_step=on_step, on_partial=save_partial, engines=only)
    _outputs([real_shapes_document(result)], json_path, png_path)
    if only is not None and (idle := sorted(only - {c["engine"] for c in result["cells"]})):
        print_note(f"note: no cell of these workloads runs {', '.join(idle)}")
    if not all(c["identical"] for c in result["cells"]):
        print_note("note: some cell's tokens differ from the script (column identical)")


def _run_sweep(names: str, *, bits, kernels_off, tokens, context, reps, outputs) -> None:
    """``bench --sweep``: forwards of 1..TOKENS tokens on random-weight models."""
    check_bits(bits)
    from ..kernels import cuda

    _check(not kernels_off or cuda(), "--kernels-off compares mlxspec's CUDA kernels: this "
           "machine is not running MLX's CUDA backend, where they are never on")
    from ..bench.report import sweep_document
    from ..bench.sweep import DEFAULT_SHAPES, parse_shapes, run_sweep

    shapes = list(DEFAULT_SHAPES) if names.strip() == "all" else parse_shapes(names)
    with progress("sweep") as on_step:
        result = run_sweep(shapes, bits=bits, max_tokens=tokens, context=context, reps=reps, on_step=on_step,
                           kernels_off=kernels_off)
    _outputs([sweep_document(result)], *outputs)


def _run_engines(model, draft_model, dtype, *, workloads_dir, workloads, prompts, max_tokens, engines, draft_depth,
                 depth, reps, temperature, temp_pass, seed, gates, outputs) -> None:
    """``bench`` itself: mlx-lm and mlxspec's engines on MODEL over the prompt sets."""
    from ..bench.fim import load_sets
    from ..bench.prompts import Bench, Options, parse_engines, parse_list
    from ..bench.report import bench_document, write_json

    chosen = parse_engines(engines)
    sets = load_sets(workloads_dir or builtin_workloads(), parse_list(workloads, "workloads"), prompts, max_tokens)
    if model is None:
        _check(DEFAULT_MODEL.is_dir(), f"give MODEL (a model folder or cached repo id): "
                                       f"there is no {DEFAULT_MODEL} in this folder")
        model = str(DEFAULT_MODEL)
        if draft_model is None and DEFAULT_DRAFT.is_dir():
            draft_model = str(DEFAULT_DRAFT)
    spec = _load(model, draft_model, dtype)
    options = Options(reps=reps or 3, draft_depth=draft_depth, depth=depth, temperature=temperature,
                      temp_pass=temp_pass, seed=seed, gates=gates)
    runner = Bench(spec, sets, chosen, options)
    for engine, why in runner.skipped.items():
        print_note(f"skipping {engine}: {why}")
    json_path, png_path = outputs

    def save_partial(result):  # the first pass survives a run stopped during the second
        if json_path:
            write_json(bench_document(runner, result), json_path)

    with progress("bench") as on_step:
        result = runner.run(on_step, save_partial)
    _outputs([bench_document(runner, result)], json_path, png_path)
    if not all(r.get("identical") is not False for p in result["passes"] for r in p["results"]):
        print_note("note: some engine's temperature-0 tokens differ from mlx-lm's (column identical)")
    sys.stdout.flush()


def _load(model: str, draft_model: Optional[str], dtype: Optional[str]):
    """MODEL and DRAFT_MODEL (aliases expanded) loaded, cast to DTYPE when given."""
    from ..hub import expand_alias

    spec = load_with_spinner(expand_alias(model), expand_alias(draft_model))
    if dtype is not None:
        _check_dtype(dtype)
        spec.astype(dtype)
    return spec


def _run_chat(model, draft_model, shapes, turns, context, user_tokens, drafter, max_tokens, reps, bits,
              dtype, json_path, png_path) -> None:
    """``bench --chat``: flags checked, then MODEL or each random shape through run_chat."""
    from ..bench.chat import chat_config, check_plan, default_user_tokens, run_chat, run_chat_shapes
    from ..bench.report import chat_document, model_info

    turns = 5 if turns is None else turns
    answer = 64 if max_tokens is None else max_tokens
    reps = reps or 3
    drafter = drafter or "pld"
    _check_dtype(dtype)
    _check(context is None or context >= 2, f"--chat-context must be at least 2, got {context}")

    def plan(context):
        user = default_user_tokens(turns, context, answer) if user_tokens is None else user_tokens
        check_plan(turns, context, user, answer)
        return chat_config(turns=turns, context=context, user_tokens=user, answer_tokens=answer,
                           reps=reps, drafter=drafter)

    if shapes is not None:
        _check(model is None and draft_model is None,
               "--chat-shapes builds its own random models: give no MODEL or --draft-model")
        check_bits(bits)
        _check(drafter in ("pld", "none"), f"--drafter with --chat-shapes must be pld or none "
                                           f"(random models have no MTP head or draft model); got {drafter}")
        from ..bench.sweep import parse_shapes

        names = parse_shapes(shapes, "--chat-shapes")
        config = plan(4096 if context is None else context)
        with progress("chat") as on_step:
            models = run_chat_shapes(names, bits=bits, dtype=dtype, on_step=on_step,
                                     **_run_args(config))
    else:
        _check(drafter in DRAFTERS, f"--drafter must be one of {', '.join(DRAFTERS)}; got {drafter}")
        _check(drafter != "draft" or draft_model is not None, "--drafter draft needs --draft-model")
        _check(drafter in ("draft", "assistant", "dflash", "auto") or draft_model is None,
               f"--draft-model is only used by --drafter draft, assistant, dflash or auto, not {drafter}")
        if context is not None:
            plan(context)  # a bad plan fails before the model loads
        spec = _load_chat_model(model, draft_model, dtype)
        limit = spec.target.context_length
        if context is None:
            context = 4096 if limit is None else min(4096, limit - answer)
        _check(limit is None or context + answer <= limit,
               f"--chat-context {context} + {answer} answer tokens exceed {spec.name}'s context of "
               f"{limit} tokens")
        config = plan(context)
        head = None
        if drafter in ("mtp", "auto"):
            head, why_not = spec.mtp_head()
            _check(head is not None or drafter == "auto", f"--drafter mtp: {why_not}")
        with progress("chat") as on_step:
            result = run_chat(spec.target.model, vocab=spec.target.vocab_size, on_step=on_step,
                              label=spec.name, mtp_head=head,
                              draft_model=spec.draft.model if spec.draft else None, **_run_args(config))
        models = [{**model_info(spec.target), "draft_model": model_info(spec.draft),
                   "random_weights": False, "dtype": dtype, **result}]
    _outputs([chat_document(models, config)], json_path, png_path)


def _run_args(config: dict) -> dict:
    return {k: config[k] for k in ("turns", "context", "user_tokens", "answer_tokens", "reps", "drafter")}


def _load_chat_model(model, draft_model, dtype):
    if model is None:
        _check(DEFAULT_MODEL.is_dir(), f"give MODEL (a model folder or cached repo id) or --chat-shapes: "
                                       f"there is no {DEFAULT_MODEL} in this folder")
        model = str(DEFAULT_MODEL)
    return _load(model, draft_model, dtype)
