#!/usr/bin/env bash
# The 16-bit codecs against f32 on GPUs (run on a GPU machine after scripts/gpu/prepare.sh):
# the ResNet-50 gradient set through ferrovod-bench gpu, none/fp16/bf16 alternating, 3 rounds.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/env.sh
export FERROVOD_DATA_DIR=$PWD/.gpu/data
for r in 1 2 3; do
  for c in none fp16 bf16; do
    out=$(FERROVOD_COMPRESSION=$c timeout 120 mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE \
      -x NCCL_RUNTIME_CONNECT -x FERROVOD_DATA_DIR -x FERROVOD_COMPRESSION \
      .gpu/ferrovod-bench gpu --min-bytes 16M --max-bytes 16M 2>&1)
    echo "round $r $c: $(echo "$out" | grep '^# resnet50:')"
    echo "$out" | grep -i "error\|panic" | head -3 || true
  done
done
