"""The flags of ``mlxspec bench`` (cli/bench.py), each declared once, so that the command's
signature reads as a list of names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..options import FLAGS, MAX_DEPTH, MIN_DEPTH, QUANT_BITS
from .console import complete_model

DEFAULT_MODEL = Path("benchmarks/models/mini-hybrid")
DEFAULT_DRAFT = Path("benchmarks/models/mini-draft")

# each option's declaration, so that the command's signature reads as a list of names
ModelArgument = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, autocompletion=complete_model,
    help=f"Target model: local folder or cached Hugging Face repo id (default: {DEFAULT_MODEL}, "
         "if that folder exists here).")]
DraftModelOption = Annotated[Optional[str], typer.Option(
    "--draft-model", metavar="PATH_OR_REPO", show_default=False,
    help=f"Draft model sharing MODEL's tokenizer, for mlx-lm-draft and mlxspec-draft (default: "
         f"{DEFAULT_DRAFT} when MODEL is the default and that folder exists).")]
WorkloadsDirOption = Annotated[Optional[str], typer.Option("--workloads-dir", metavar="DIR", show_default=False,
                              help="Folder of NAME.jsonl prompt sets. \\[default: the built-in sets]")]
WorkloadsOption = Annotated[Optional[str], typer.Option(
    "--workloads", metavar="NAMES", show_default=False,
    help="Comma-separated workload names, e.g. echo,fim (default: every .jsonl in DIR; fim: see above).")]
PromptsOption = Annotated[Optional[int], typer.Option(
    "--prompts", metavar="N", show_default=False,
    help="Use only the first N prompts of each workload (default: all).")]
MaxTokensOption = Annotated[Optional[int], typer.Option(
    "--max-tokens", metavar="N", show_default=False,
    help="Tokens to generate per prompt, replacing each prompt's own max_tokens.")]
EnginesOption = Annotated[Optional[str], typer.Option(
    "--engines", metavar="NAMES", show_default=False,
    help="Comma-separated subset of mlx-lm, mlx-lm-draft, mlxspec-none, mlxspec-pld, "
         "mlxspec-draft, mlxspec-mtp, mlxspec-assistant, mlxspec-auto (default: all; mlx-lm always runs). "
         "With --real-shapes: of mlx-lm-draft, mlx-lm-kernels (mlx-lm with mlxspec's kernels) and "
         "mlxspec-none, -pld, -mtp, -draft, -assistant, -dflash; stock mlx-lm always runs.")]
RepsOption = Annotated[Optional[int], typer.Option(
    "--reps", metavar="N", show_default=False,
    help="Repetitions, of which the median is reported (default 3; with --sweep: timed "
         "forwards per width, default 5).")]
DraftDepthOption = Annotated[int, typer.Option(
    "--draft-depth", metavar="K", help="Tokens mlx-lm-draft drafts per step (num_draft_tokens).")]
DepthOption = Annotated[Optional[int], typer.Option(
    "--depth", metavar="K", show_default=False,
    help="Fixed draft depth for the mlxspec engines (default: each engine chooses, as in `run`).")]
GatesOption = Annotated[bool, typer.Option(
    "--gates/--no-gates", help="Let the mlxspec engines switch speculation off where it does not "
                               "pay (as `run` does); --no-gates drafts at every step, to see "
                               "the drafters' acceptance apart from the gates' decisions.")]
TemperatureOption = Annotated[float, typer.Option(
    *FLAGS["temperature"], metavar="T", help="Temperature of the second (sampling) pass (--temp or --temperature).")]
TempPassOption = Annotated[bool, typer.Option(
    "--temp-pass/--no-temp-pass", help="Run the second pass at --temp (mlx-lm and the "
                                       "engines that draft), after the temperature-0 pass.")]
SeedOption = Annotated[int, typer.Option(
    "--seed", help="Seed of the sampling pass: prompt i of every engine starts from seed + i.")]
JsonPathOption = Annotated[Optional[str], typer.Option(
    "--json", metavar="PATH", show_default=False,
    help="Write every raw number (per prompt and repetition), the medians, the environment "
         "(versions, device, models) and the command line to PATH.")]
PngPathOption = Annotated[Optional[str], typer.Option(
    "--png", metavar="PATH", show_default=False,
    help='Draw a bar chart of the speedups (a line chart for --sweep) to PATH; needs '
         'matplotlib (pip install "mlxspec\\[bench]").')]
FromJsonOption = Annotated[Optional[list[str]], typer.Option(
    "--from-json", metavar="PATH", show_default=False,
    help="Run nothing: print the tables of saved --json results (repeatable; --png draws "
         "them all in one chart).")]
SweepOption = Annotated[Optional[str], typer.Option(
    "--sweep", metavar="SHAPES", show_default=False,
    help="Instead of the engines: time forwards of 1..--sweep-tokens tokens over a warm cache "
         "on random weights shaped like these (comma-separated): qwen3-0.6b, qwen3-1.7b, "
         "qwen3-8b, qwen3.5-9b-like, qwen3.6-27b, or smoke / smoke-hybrid (tiny); 'all' is "
         "qwen3-1.7b,qwen3-8b,qwen3.5-9b-like,qwen3.6-27b.")]
BitsOption = Annotated[int, typer.Option(
    "--bits", help="Sweep: quantize the random weights to this many bits (0: bf16).")]
SweepTokensOption = Annotated[int, typer.Option(
    "--sweep-tokens", metavar="N", help="Sweep: the largest forward, in tokens.")]
DtypeOption = Annotated[Optional[str], typer.Option(
    "--dtype", metavar="DTYPE",
    help="Cast the loaded models (and MTP head) to float32, bfloat16 or float16 before "
         "measuring (default: as stored). float32 makes the identity column meaningful on "
         "backends whose bf16 kernels do not repeat bit for bit.")]
SweepContextOption = Annotated[int, typer.Option(
    "--sweep-context", metavar="N", help="Sweep: tokens in the cache at the start (each "
                                         "forward keeps one token, so every call meets a new "
                                         "key length, as in generation).")]
ChatOption = Annotated[bool, typer.Option(
    "--chat", help="Instead of the engines: time to first token on each turn of a growing "
                   "chat, with and without prefix reuse, and mlx-lm's (see above).")]
ChatShapesOption = Annotated[Optional[str], typer.Option(
    "--chat-shapes", metavar="SHAPES", show_default=False,
    help="Chat: instead of MODEL, random-weight models of these shapes (comma-separated, as "
         "for --sweep, quantized to --bits), one at a time.")]
ChatTurnsOption = Annotated[Optional[int], typer.Option(
    "--chat-turns", metavar="N", show_default=False, help="Chat: turns (default 5).")]
ChatContextOption = Annotated[Optional[int], typer.Option(
    "--chat-context", metavar="N", show_default=False,
    help="Chat: tokens in the last turn's prompt (default 4096, or what MODEL's context "
         "leaves after the answer).")]
ChatUserTokensOption = Annotated[Optional[int], typer.Option(
    "--chat-user-tokens", metavar="N", show_default=False,
    help="Chat: tokens of each user block after the first (default 256, fewer when "
         "--chat-context is too short for that).")]
DrafterOption = Annotated[Optional[str], typer.Option(
    "--drafter", metavar="NAME", show_default=False,
    help="Chat: the engine's drafter: pld (default), none, or with MODEL also mtp, auto, draft / "
         "assistant / dflash (with --draft-model: a draft model, Gemma-4 assistant, DFlash drafter).")]
ConcurrencyOption = Annotated[Optional[str], typer.Option(
    "--concurrency", metavar="LIST", show_default=False,
    help="Requests at once, e.g. 1,2,4,8: mlxspec's batch against mlxspec serial and mlx-lm's batched "
         "decoding (no speculation) on MODEL, --workloads' prompts (default echo), --drafter (default auto). "
         "With --real-shapes SHAPE instead of MODEL: a scripted random model of that shape against STOCK "
         "mlx-lm's batching in a process of its own (workloads echo,mtp-like; prompt lookup / the MTP head).")]
JoinTokensOption = Annotated[Optional[int], typer.Option(
    "--join-tokens", metavar="N", show_default=False,
    help="With --concurrency: also time a request's gaps while an N-token prompt joins its batch.")]
RealShapesOption = Annotated[Optional[str], typer.Option(
    "--real-shapes", metavar="SHAPES", show_default=False,
    help="Instead of MODEL: the engines on scripted random-weight models of these shapes "
         "(comma-separated, as for --sweep, plus qwen3.6-35b-a3b, smoke-moe, gemma-4-31b, "
         "gemma-4-26b-a4b, smoke-gemma4(-moe)); 'all' is qwen3-1.7b,qwen3-8b,qwen3.6-27b,qwen3.6-35b-a3b. "
         "Default --reps 8, --max-tokens 128, --workloads echo,novel,scripted-a0.8,scripted-a0.6,scripted-a1.0.")]
PromptTokensOption = Annotated[int, typer.Option(
    "--prompt-tokens", metavar="N", help="Real shapes: tokens in each workload's prompt.")]
DepthsOption = Annotated[str, typer.Option(
    "--depths", metavar="LIST", help="Real shapes: the forced depths of the ideal curve "
                                     f"(comma-separated, {MIN_DEPTH}-{MAX_DEPTH}).")]
ShardedOption = Annotated[bool, typer.Option(
    "--sharded", help="With --real-shapes: the target sharded over the processes of an mlx.launch run "
                      "(tensor parallel, mlx-lm's shard), mlxspec plain / prompt lookup (echo) / the MTP head "
                      "(mtp-like) against mlx-lm's plain decoding of the same shards in the same processes; "
                      "without mlx.launch, the same on this device alone (the scaling reference). No mlxspec "
                      "kernels on either. Rank 0 prints and writes --json. Default --workloads echo,mtp-like.")]
KernelsOffOption = Annotated[bool, typer.Option(
    "--kernels-off", help="Sweep: also time every shape with mlxspec's CUDA kernels off "
                          "(MLXSPEC_KERNELS=0: MLX's and mlx-lm's own paths), same weights, as a column "
                          "'SHAPE (kernels off)'. Only on MLX's CUDA backend.")]


def check_bits(bits: int) -> None:
    """--bits of the random-weight models (--sweep, --real-shapes, --chat-shapes)."""
    if bits not in QUANT_BITS:
        raise UsageError(f"--bits must be 0 (bf16) or 2, 3, 4, 5, 6, 8; got {bits}")
