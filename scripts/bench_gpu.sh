#!/usr/bin/env bash
# The benchmark-issue runs on the GPU machine: `mlxspec bench` over the mini model family and
# the verify-cost sweep, results as JSON (and PNG charts where matplotlib is installed).
#
#   bash scripts/bench_gpu.sh OUTDIR [PART ...]
#
# PART: hybrid (benchmarks/models/mini-hybrid), attn (benchmarks/models/mini-attn), sweep (random
# 4-bit Qwen3-1.7B / Qwen3-8B / Qwen3.5-9B-like / Qwen3.6-27B shapes), real (`bench --real-shapes`:
# see below; not in the default list), chart (PNGs from the JSON files already in OUTDIR).
# Default: hybrid attn sweep chart, in that order. Each part is one process; run them
# in separate calls where one call has a time limit. Writes OUTDIR/mini-hybrid.json,
# mini-attn.json, sweep.json and, with matplotlib, bench.png and sweep.png (5 files).
#
# On the GPU machine, after staging MLX's CUDA wheel (../shared/device/README.md):
#   source .cu3/stage.sh && bash scripts/bench_gpu.sh "$OUT" hybrid attn
#   source .cu3/stage.sh && bash scripts/bench_gpu.sh "$OUT" sweep
# A device call runs at most 10 minutes: all 32 prompts x 256 tokens x 3 repetitions x 2 passes
# of one model may not fit in one (not timed yet); run one model per call, and if it is cut off,
# use PROMPTS=4 (the JSON is saved after the temperature-0 pass, and again at the end).
# Without matplotlib there, draw the charts later anywhere with the JSON files:
#   mlxspec bench --from-json mini-hybrid.json --from-json mini-attn.json --png bench.png
#   mlxspec bench --from-json sweep.json --png sweep.png
#
# real: scripted random-weight models of real shapes against STOCK mlx-lm, which runs in a process
# of its own that never imports mlxspec's kernels (the JSON's "baseline" and each shape's
# "baseline_evidence" say so), repetitions ABAB (REAL_REPS, default 8), paired ratios with median
# and IQR. Writes OUTDIR/real-TAG.json (TAG: REAL_TAG, else the shapes and workloads) after every
# repetition, so a call cut off at 10 minutes keeps the repetitions done. All five default
# workloads of one 8B shape run ~80 paired runs a repetition: split them over calls, e.g.
#   REAL_SHAPES=qwen3-8b REAL_WORKLOADS=echo,novel bash scripts/bench_gpu.sh "$OUT" real
#   REAL_SHAPES=qwen3-8b REAL_WORKLOADS=scripted-a0.8,mtp-like bash scripts/bench_gpu.sh "$OUT" real
# Knobs: REAL_SHAPES (qwen3-8b), REAL_WORKLOADS (echo,novel,mtp-like), REAL_REPS (8), REAL_TOKENS
# (max tokens, 128), REAL_TAG, REAL_EXTRA (more flags, e.g. "--depths 1,2,4 --no-temp-pass").
#
# concurrency: `bench --real-shapes SHAPE --concurrency` (requests at once against stock mlx-lm's
# BatchGenerator): REAL_SHAPES (one shape, qwen3-8b), REAL_WORKLOADS (echo,mtp-like), CONCURRENCY
# (1,2,4), JOIN_TOKENS (a prompt of that many tokens joins the running ones: gaps timed), REAL_REPS,
# REAL_TOKENS, REAL_TAG, REAL_EXTRA; writes OUTDIR/concurrency-TAG.json after every repetition.
#
# Knobs (environment): REPS (3), PROMPTS (all), MAX_TOKENS (each prompt's own), SWEEP (all),
# SWEEP_TOKENS (16), BITS (4), MODELS (benchmarks/models), WORKLOADS (benchmarks/workloads),
# PYTHON (python3), EXTRA (more `mlxspec bench` flags).
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: bash scripts/bench_gpu.sh OUTDIR [hybrid|attn|sweep|real|chart ...]" >&2
    exit 2
fi
OUTDIR=$(mkdir -p "$1" && cd "$1" && pwd)
shift
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(hybrid attn sweep chart)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
MODELS=${MODELS:-benchmarks/models}

common=(--reps "${REPS:-3}" --workloads-dir "${WORKLOADS:-benchmarks/workloads}")
[ -n "${PROMPTS:-}" ] && common+=(--prompts "$PROMPTS")
[ -n "${MAX_TOKENS:-}" ] && common+=(--max-tokens "$MAX_TOKENS")
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && common+=($EXTRA)

mlxspec() { "$PYTHON" -m mlxspec "$@"; }

"$PYTHON" -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'

for part in "${PARTS[@]}"; do
    case "$part" in
        hybrid|attn)
            model="$MODELS/mini-$part"
            if [ ! -d "$model" ]; then
                echo "skipping $part: no $model" >&2
                continue
            fi
            draft=()
            [ -d "$MODELS/mini-draft" ] && draft=(--draft-model "$MODELS/mini-draft")
            mlxspec bench "$model" "${draft[@]}" "${common[@]}" --json "$OUTDIR/mini-$part.json"
            ;;
        sweep)
            mlxspec bench --sweep "${SWEEP:-all}" --bits "${BITS:-4}" --sweep-tokens "${SWEEP_TOKENS:-16}" \
                --json "$OUTDIR/sweep.json"
            ;;
        real)
            shapes=${REAL_SHAPES:-qwen3-8b}
            workloads=${REAL_WORKLOADS:-echo,novel,mtp-like}
            tag=${REAL_TAG:-$(echo "$shapes-$workloads" | tr ',.' '_-')}
            # shellcheck disable=SC2206
            extra=(${REAL_EXTRA:-})
            mlxspec bench --real-shapes "$shapes" --workloads "$workloads" --reps "${REAL_REPS:-8}" \
                --max-tokens "${REAL_TOKENS:-128}" --bits "${BITS:-4}" "${extra[@]}" --json "$OUTDIR/real-$tag.json"
            ;;
        concurrency)
            # requests at once on one scripted real shape against stock mlx-lm's BatchGenerator
            shape=${REAL_SHAPES:-qwen3-8b}
            workloads=${REAL_WORKLOADS:-echo,mtp-like}
            tag=${REAL_TAG:-$(echo "$shape-$workloads" | tr ',.' '_-')}
            join=()
            [ -n "${JOIN_TOKENS:-}" ] && join=(--join-tokens "$JOIN_TOKENS")
            # shellcheck disable=SC2206
            extra=(${REAL_EXTRA:-})
            mlxspec bench --real-shapes "$shape" --concurrency "${CONCURRENCY:-1,2,4}" --workloads "$workloads" \
                --reps "${REAL_REPS:-8}" --max-tokens "${REAL_TOKENS:-128}" --bits "${BITS:-4}" "${join[@]}" \
                "${extra[@]}" --json "$OUTDIR/concurrency-$tag.json"
            ;;
        chart)
            if ! "$PYTHON" -c 'import matplotlib' 2>/dev/null; then
                echo "no matplotlib here: draw the charts later with mlxspec bench --from-json ... --png ..." >&2
                continue
            fi
            inputs=()
            for f in "$OUTDIR/mini-hybrid.json" "$OUTDIR/mini-attn.json"; do
                [ -f "$f" ] && inputs+=(--from-json "$f")
            done
            [ ${#inputs[@]} -gt 0 ] && mlxspec bench "${inputs[@]}" --png "$OUTDIR/bench.png" > /dev/null
            [ -f "$OUTDIR/sweep.json" ] && mlxspec bench --from-json "$OUTDIR/sweep.json" --png "$OUTDIR/sweep.png" > /dev/null
            for f in "$OUTDIR"/real-*.json; do
                [ -f "$f" ] && mlxspec bench --from-json "$f" --png "${f%.json}.png" > /dev/null
            done
            ;;
        *)
            echo "unknown part '$part' (hybrid, attn, sweep, real, concurrency, chart)" >&2
            exit 2
            ;;
    esac
done
