#!/usr/bin/env bash
# Compares settings of the PyTorch training benchmark in one device call (run there, after
# scripts/gpu/prepare.sh here): each VARIANT is `label` or `label:NAME=VALUE,NAME=VALUE`, run
# in turn, the whole list REPEAT times (so drift hits every variant alike), each run printing
# images/s, the ratios and per-step times (scripts/gpu/bench_torch.py --step-stats).
#   bash scripts/gpu/ab_torch.sh [-r REPEAT] [-a "bench_torch.py args"] VARIANT...
# e.g. bash scripts/gpu/ab_torch.sh -r 2 default one-stream:HOROVOD_NUM_NCCL_STREAMS=1
set -uo pipefail
cd "$(dirname "$0")/../.."
repeat=1
args="--modes nocomm,ddp,ferrovod --rounds 2 --steps 20"
while getopts "r:a:" opt; do
  case $opt in
    r) repeat=$OPTARG ;;
    a) args=$OPTARG ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
source scripts/gpu/env.sh
for ((k = 1; k <= repeat; k++)); do
  for variant in "$@"; do
    label=${variant%%:*}
    envs=()
    [[ $variant == *:* ]] && IFS=, read -r -a envs <<<"${variant#*:}"
    echo "== $label (round $k) ${envs[*]:-}"
    xs=()
    for kv in "${envs[@]}"; do xs+=(-x "${kv%%=*}"); done
    env "${envs[@]}" timeout 300 mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE -x NCCL_RUNTIME_CONNECT \
      -x PYTHONUNBUFFERED -x TORCH_SYMM_MEM_DISABLE_MULTICAST "${xs[@]}" \
      python3 scripts/gpu/bench_torch.py $args --step-stats 2>&1 |
      grep "images/s\|ferrovod/\|step ms\|python cost" | tee -a "$out/ab_torch.log"
  done
done
