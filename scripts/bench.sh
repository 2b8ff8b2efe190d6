#!/usr/bin/env bash
# The main job for now: ferrovod-bench under mpirun -np 2, the size sweep and the ResNet-50
# preset, each against raw MPI_Allreduce in the same run. Extra arguments go to ferrovod-bench.
# NP=4 bash scripts/bench.sh runs more ranks (oversubscribed when there are fewer cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release --bin ferrovod-bench
np="${NP:-2}"
if [ "$np" -le "$(nproc)" ]; then
  binding=(--bind-to core)   # each rank and its background thread share a core: steadier timings
else
  binding=(--bind-to none --oversubscribe --mca mpi_yield_when_idle 1)
fi
mpirun -np "$np" "${binding[@]}" target/release/ferrovod-bench all "$@"
