#!/usr/bin/env bash
# Builds, on the development machine, what scripts/gpu/check.sh runs on a GPU machine (which has
# no Rust toolchain): the release benchmark and MPI test binaries and the gradient shape data,
# stripped, into .gpu/ (ignored by git; pass it to the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --bin ferrovod-bench --test mpi
test_bin=$(cargo test --release --test mpi --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "mpi" and m.get("executable"):
        print(m["executable"])')
rm -rf .gpu && mkdir -p .gpu/data
cp target/release/ferrovod-bench .gpu/ferrovod-bench
cp "$test_bin" .gpu/mpi-tests
strip --strip-debug .gpu/ferrovod-bench .gpu/mpi-tests
data=${FERROVOD_DATA_DIR:-../shared/data}
cp "$data/resnet50_grads.tsv" "$data/bert_base_grads.tsv" .gpu/data/
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"; grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >> "$ex"
du -sh .gpu
