#!/usr/bin/env bash
# ferrovod-bench negotiation at np = 2, 4, 8 and 16 (oversubscribed beyond the cores): control
# collectives, control bytes and negotiation time per simulated ResNet-50 / BERT-base step in
# each negotiation mode (horovod, online, offline), with the cost model's extrapolation.
# NPS="2 4" bash scripts/bench-negotiation.sh picks other sizes; extra arguments go to the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release --bin ferrovod-bench
for np in ${NPS:-2 4 8 16}; do
  mpirun -np "$np" --bind-to none --oversubscribe --mca mpi_yield_when_idle 1 \
    target/release/ferrovod-bench negotiation "$@"
done
