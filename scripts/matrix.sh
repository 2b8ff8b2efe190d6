#!/usr/bin/env bash
# The combination matrix: framework (C API, TensorFlow, PyTorch, MXNet) x memory x codec (none,
# fp16, bf16, mixed, u8) x mode (online, offline, multistep, gossip) x named/unnamed ops, at
# np 2 and 4. Each cell runs >= 1,000 operations (allreduce sum and average, grouped allreduce,
# allgather, broadcast, an integer allreduce; gossip in gossip mode), checks every result
# against a NumPy float64 reference within the codec's documented error, and that resident
# memory stays flat; it prints one table and exits 1 if any cell fails (tests/matrix/README.md).
# Usage: bash scripts/matrix.sh [--sample] [--gpu] [--filter REGEX] [--logdir DIR]
#   (default) every host cell (35-65 min on 2 cores, by load);
#   --sample  each framework, codec, mode and naming at least once at np 2 and 4 (CI, about
#             100 s on an idle 2-core machine);
#   --gpu     torch CUDA tensors and the C API on device memory, at np 2 and 4 where there are
#             that many GPUs (the GPU machine; skipped where there is none). With --sample, a
#             sample of those.
#   --table RESULTS_JSONL...  the table of earlier runs (logdir/results.jsonl), joined.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
for a in "$@"; do
  if [ "$a" = --gpu ]; then
    if ! nvidia-smi -L >/dev/null 2>&1; then
      echo "matrix --gpu: no GPU here, skipped"
      exit 0
    fi
    # the GPU machine: its own Python with torch, ferrovod's wheel installed into it by
    # scripts/gpu/env.sh from what scripts/gpu/prepare.sh staged in .gpu/wheels
    source scripts/gpu/env.sh
    py=python3
  fi
done
exec "$py" tests/matrix/matrix.py "$@"
