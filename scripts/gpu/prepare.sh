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
# the Python packages the PyTorch tests and benchmark import there (scripts/gpu/torch.sh):
# ferrovod and horovod as scripts/setup-python.sh installed them into .venv (the library is
# plain C ABI, whichever Python runs it), and the pure-Python packages the GPU machine lacks
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p .gpu/py
for pkg in ferrovod horovod cloudpickle pytest _pytest pluggy iniconfig packaging pygments py.py; do
  [ -e "$site/$pkg" ] && cp -r "$site/$pkg" .gpu/py/
done
find .gpu/py -name __pycache__ -prune -exec rm -rf {} +
strip --strip-debug .gpu/py/ferrovod/libferrovod*.so
# Horovod's own test_torch.py for scripts/gpu/torch.sh horovod, when a Horovod source tree is
# named (its files are copied into .gpu/ only, never into the repository; docs/horovod-tests.md)
if [ -n "${FERROVOD_HOROVOD_TREE:-}" ]; then
  mkdir -p .gpu/htest
  cp "$FERROVOD_HOROVOD_TREE/test/parallel/test_torch.py" "$FERROVOD_HOROVOD_TREE/test/utils/common.py" .gpu/htest/
  # the file imports the `mock` backport
  printf 'from unittest.mock import *  # noqa: F401,F403\nversion_info = (5, 0, 0)\n' >.gpu/htest/mock.py
fi
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"; grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >> "$ex"
du -sh .gpu
