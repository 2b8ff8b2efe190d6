#!/usr/bin/env bash
# Builds, on the development machine, what scripts/gpu/check.sh runs on a GPU machine (which has
# no Rust toolchain): the release benchmark and MPI test binaries, the gradient shape data and
# the wheels of the Python packages, into .gpu/ (ignored by git; pass it to the device tool's
# `carry`).
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
# the Python packages, as users install them: ferrovod's wheel (scripts/wheel.sh) and the
# pure-Python wheels the tests need there (the versions .venv has), installed on the GPU
# machine by scripts/gpu/env.sh with pip from .gpu/wheels alone (it has no Rust and no internet)
bash scripts/wheel.sh >/dev/null
mkdir -p .gpu/wheels
cp dist/ferrovod-*.whl .gpu/wheels/
# PyTorch's test utilities (scripts/torch-tests.sh there) import expecttest, which neither
# torch nor setup-python.sh installs
.venv/bin/python -c "import expecttest" 2>/dev/null || .venv/bin/python -m pip install -q expecttest
pins=$(.venv/bin/python -c 'import importlib.metadata as md
print(" ".join("%s==%s" % (p, md.version(p)) for p in
      ("cloudpickle", "packaging", "pytest", "pluggy", "iniconfig", "pygments", "expecttest")))')
# shellcheck disable=SC2086 # one argument per pin
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels $pins
# Horovod's own test_torch.py for scripts/gpu/torch.sh horovod, when a Horovod source tree is
# named (its files are copied into .gpu/ only, never into the repository; docs/horovod-tests.md)
if [ -n "${FERROVOD_HOROVOD_TREE:-}" ]; then
  mkdir -p .gpu/htest
  cp "$FERROVOD_HOROVOD_TREE/test/parallel/test_torch.py" "$FERROVOD_HOROVOD_TREE/test/utils/common.py" .gpu/htest/
  # the file imports the `mock` backport
  printf 'from unittest.mock import *  # noqa: F401,F403\nversion_info = (5, 0, 0)\n' >.gpu/htest/mock.py
fi
# iproute2's ip and tc, with the libraries they need beyond the C library, for emulated hosts
# on the GPU machine's CPUs (scripts/gpu/hosts.sh; that machine has no iproute2)
if command -v ip >/dev/null && command -v tc >/dev/null; then
  mkdir -p .gpu/iproute2/bin .gpu/iproute2/lib
  for b in ip tc; do
    cp "$(command -v $b)" .gpu/iproute2/lib/
    ldd "$(command -v $b)" | awk '/=>/ && $1 !~ /^lib(c|m)\.so/ {print $3}' | xargs -r cp -L -t .gpu/iproute2/lib/
    printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/../lib\nLD_LIBRARY_PATH=$d exec "$d/%s" "$@"\n' "$b" >.gpu/iproute2/bin/$b
    chmod +x .gpu/iproute2/bin/$b
  done
fi
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"; grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >> "$ex"
du -sh .gpu
