#!/usr/bin/env bash
# Runs every check: formatting, clippy, unit tests, the C API program, the multi-rank
# scenarios under mpirun (np 2, 3 and 4, oversubscribed), then the Python packages in .venv
# (pytest under mpirun -np 2 and 4, and the launcher).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
cargo build --release
cargo test --release

bash scripts/setup-python.sh
py=(.venv/bin/python -m pytest -q -p no:cacheprovider --color=no)
for np in 2 4; do
  timeout 600 mpirun -np "$np" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
    "${py[@]}" tests/python/mpi
done
timeout 600 "${py[@]}" tests/python/single
