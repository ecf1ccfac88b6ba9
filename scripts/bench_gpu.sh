#!/usr/bin/env bash
# The benchmark-issue runs on the GPU machine: `mlxspec bench` over the mini model family and
# the verify-cost sweep, results as JSON (and PNG charts where matplotlib is installed).
#
#   bash scripts/bench_gpu.sh OUTDIR [PART ...]
#
# PART: hybrid (benchmarks/models/mini-hybrid), attn (benchmarks/models/mini-attn), sweep (random
# 4-bit Qwen3-1.7B / Qwen3-8B / Qwen3.5-9B-like / Qwen3.6-27B shapes), chart (PNGs from the JSON
# files already in OUTDIR). Default: all four, in that order. Each part is one process; run them
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
# Knobs (environment): REPS (3), PROMPTS (all), MAX_TOKENS (each prompt's own), SWEEP (all),
# SWEEP_TOKENS (16), BITS (4), MODELS (benchmarks/models), WORKLOADS (benchmarks/workloads),
# PYTHON (python3), EXTRA (more `mlxspec bench` flags).
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: bash scripts/bench_gpu.sh OUTDIR [hybrid|attn|sweep|chart ...]" >&2
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
            ;;
        *)
            echo "unknown part '$part' (hybrid, attn, sweep, chart)" >&2
            exit 2
            ;;
    esac
done
