#!/usr/bin/env bash
# Everything ferrovod checks and measures on a GPU machine, building nothing (run
# scripts/gpu/prepare.sh on the development machine first and carry .gpu/):
#   1. the MPI scenarios in GPU mode: every op x dtype on GPU memory at np 2 (and 4 where there
#      are 4 GPUs) against host-computed references, mismatch errors, join, process sets,
#      channels, asynchronous completion, caller streams/events, the NVRTC kernels; then a
#      sample of the combination matrix on GPU memory;
#   2. the allreduce benchmark: ferrovod vs raw NCCL in one process, 1 MiB - 1 GiB, and the
#      ResNet-50 gradient set vs one NCCL allreduce of the same bytes;
#   3. NCCL through PyTorch (torch.distributed.all_reduce) at the same sizes;
#   4. the table joining them, last.
# Usage: bash scripts/gpu/check.sh [tests|bench|all] (default all). Output also in $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
source scripts/gpu/env.sh
export FERROVOD_DATA_DIR=$PWD/.gpu/data
echo "# $(date -u +%F) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$ngpu, $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
rc=0
if [ "$what" != bench ]; then
  FERROVOD_TEST_GPU=1 ./.gpu/mpi-tests 2>&1 | tee "$out/tests.log" || rc=1
  # the combination matrix on GPU memory (torch CUDA tensors, the C API on device memory), a
  # sample; `bash scripts/matrix.sh --gpu` runs every cell
  bash scripts/matrix.sh --gpu --sample --logdir "$out/matrix" 2>&1 | tee "$out/matrix.log" || rc=1
fi
if [ "$what" != tests ]; then
  : > "$out/bench.jsonl"
  for np in 2 4 8; do
    [ "$np" -le "$ngpu" ] || continue
    mpirun -np "$np" --bind-to none -x NCCL_NVLS_ENABLE -x NCCL_RUNTIME_CONNECT -x FERROVOD_DATA_DIR \
      ./.gpu/ferrovod-bench gpu --floors 2>&1 | tee -a "$out/bench.log" | grep '^JSON ' | sed 's/^JSON //' >> "$out/bench.jsonl" || rc=1
    mpirun -np "$np" --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x PYTHONUNBUFFERED \
      python3 scripts/gpu/torch_allreduce.py .gpu/data/resnet50_grads.tsv 2>&1 | tee -a "$out/torch.log" | grep '^JSON ' | sed 's/^JSON //' >> "$out/bench.jsonl" || rc=1
  done
  python3 scripts/gpu/summary.py "$out/bench.jsonl" | tee "$out/summary.txt"
fi
exit $rc
