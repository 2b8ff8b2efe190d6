#!/usr/bin/env bash
# The main job for now: ferrovod-bench under mpirun -np 2, the size sweep and the ResNet-50
# preset, each against raw MPI_Allreduce in the same run. Extra arguments go to ferrovod-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release --bin ferrovod-bench
mpirun -np "${NP:-2}" --bind-to none target/release/ferrovod-bench all "$@"
