#!/usr/bin/env bash
# Issue 32's measurement on the two-GPU machine: `bench --real-shapes SHAPE --sharded` on one GPU
# (the scaling reference), then over both GPUs with MLX's NCCL backend through mlx.launch, in
# one call so both ratios come from the same machine. Each writes its JSON after every repetition.
#
#   bash scripts/bench_sharded_gpu.sh OUTDIR [SHAPE ...]      (default: qwen3-8b)
#
# On the GPU machine (kind nvidia-h100-x2), after staging MLX's CUDA wheel (../shared/device/README.md):
#   source .cu3/stage.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash scripts/bench_sharded_gpu.sh "$OUT" qwen3-8b
# Knobs: REPS (8), TOKENS (max tokens, 128), WORKLOADS (echo,mtp-like), WHERE ("1 2": one GPU, then
# two). NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device notes ask.
set -euo pipefail
out="$1"; shift
shapes=("${@:-qwen3-8b}")
reps="${REPS:-8}"; tokens="${TOKENS:-128}"; workloads="${WORKLOADS:-echo,mtp-like}"
export PATH="/root/site/bin:$PATH"
for shape in "${shapes[@]}"; do
  for n in ${WHERE:-1 2}; do
    args=(-m mlxspec bench --real-shapes "$shape" --sharded --reps "$reps" --max-tokens "$tokens"
          --workloads "$workloads" --json "$out/sharded-$shape-${n}gpu.json")
    echo "== $shape on $n GPU(s) =="
    if [ "$n" = 1 ]; then
      CUDA_VISIBLE_DEVICES=0 python3 "${args[@]}"
    else
      mlx.launch --backend nccl -n "$n" --env NCCL_NVLS_ENABLE=0 --env "PYTHONPATH=$PYTHONPATH" \
        --env "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" -- python3 "${args[@]}"
    fi
  done
done
