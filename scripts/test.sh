#!/usr/bin/env bash
# Runs every check: formatting, clippy, unit tests, the C API program and the multi-rank
# scenarios under mpirun (np 2, 3 and 4, oversubscribed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
cargo build --release
cargo test --release
