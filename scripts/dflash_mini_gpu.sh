#!/usr/bin/env bash
# One GPU call: train the mini DFlash drafter against the frozen mini-attn (PyTorch), then
# measure it with mlxspec on MLX's CUDA backend. Results under OUTDIR (at most 6 files):
#   mini-attn-DFlash.tar               the new checkpoint (config.json, model.safetensors,
#                                      reference.json, train_metrics.json): untar into benchmarks/models/
#   mini_dflash_acceptance.json        per-position greedy acceptance, DFlash depth 7 vs the MTP head
#   mini_dflash_acceptance_prev.json   the same for the drafter already in benchmarks/models/mini-attn-DFlash
#                                      (when there is one): the better of the two (tokens per verify at
#                                      depth 7) is the one timed below, and named in the log
#   mini_dflash_speed.json             plain vs DFlash vs MTP, interleaved, REPS reps, median + IQR
#   mini_dflash_bench.json             `mlxspec bench` (float32; mlxspec-auto is the DFlash drafter)
#
# On the GPU machine, after device calls 1 and 2 of ../shared/device/README.md (.cu1, .cu2), with
# carry [".cu3"]:
#   set -o pipefail; bash scripts/dflash_mini_gpu.sh "$OUT" 2>&1 | tee "$OUT/log"
# Knobs: MINUTES (training budget, 3.5), REPS (speed repetitions, 8), TRAIN_ARGS (more trainer flags).
set -uo pipefail
OUTDIR=$(mkdir -p "${1:?usage: dflash_mini_gpu.sh OUTDIR}" && cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" || exit 1

# MLX's CUDA wheel installs on the CPU while the GPU trains
( source .cu3/stage.sh ) > /tmp/stage.log 2>&1 &
stage=$!
# shellcheck disable=SC2086
python3 scripts/train_dflash_mini.py --prep --work /tmp/mini --out /tmp/ckpt --minutes "${MINUTES:-3.5}" --seed 0 \
    ${TRAIN_ARGS:-} || exit 1
tar -C /tmp/ckpt -cf "$OUTDIR/mini-attn-DFlash.tar" mini-attn-DFlash
echo "trained at $(( $(date +%s) - t0 )) s"
wait $stage
cat /tmp/stage.log
source .cu3/stage.sh || exit 1
export PYTHONPATH="$PWD:$PYTHONPATH"
measure() { python3 scripts/measure_dflash_mini.py "$@"; }

new=/tmp/ckpt/mini-attn-DFlash
old=benchmarks/models/mini-attn-DFlash
measure acceptance --drafter "$new" --json "$OUTDIR/mini_dflash_acceptance.json"
best=$new
if [ -f "$old/model.safetensors" ]; then
    measure acceptance --drafter "$old" --configs dflash-d7 --json "$OUTDIR/mini_dflash_acceptance_prev.json"
    best=$(python3 - "$OUTDIR" "$new" "$old" <<'EOF'
import json, sys
out, new, old = sys.argv[1:]
tpv = lambda f: json.load(open(f"{out}/{f}"))["configs"]["dflash-d7"]["all"]["tokens_per_verify"] or 0
print(new if tpv("mini_dflash_acceptance.json") >= tpv("mini_dflash_acceptance_prev.json") else old)
EOF
)
fi
echo "timing the drafter in $best (acceptance at $(( $(date +%s) - t0 )) s)"
if [ "$best" = "$new" ]; then rm -rf "$old"; cp -r "$new" "$old"; fi

measure speed --reps "${REPS:-8}" --json "$OUTDIR/mini_dflash_speed.json"
echo "speed at $(( $(date +%s) - t0 )) s"
timeout 100 python3 -m mlxspec bench benchmarks/models/mini-attn --draft-model "$old" \
    --engines mlx-lm,mlxspec-none,mlxspec-mtp,mlxspec-auto --dtype float32 --prompts 1 --reps 3 --no-temp-pass \
    --workloads-dir benchmarks/workloads --json "$OUTDIR/mini_dflash_bench.json"
echo "done at $(( $(date +%s) - t0 )) s"
