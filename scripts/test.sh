#!/usr/bin/env bash
# Runs every check: the setup checks, formatting, clippy, unit tests, the C API program, the
# multi-rank scenarios under mpirun (np 2, 3 and 4, oversubscribed), the fuzz targets for a
# bounded time, then the Python packages in .venv (pytest under mpirun -np 2 and 4, and the
# launcher, the PyTorch binding) and the MXNet binding in .venv-mxnet.
set -euo pipefail
cd "$(dirname "$0")/.."
# one line per stage, with the time since the start, so a long stage does not read as a hang
started=$SECONDS
stage() {
  local t=$((SECONDS - started))
  printf '\n==> [%d:%02d] %s\n' $((t / 60)) $((t % 60)) "$*"
}
trap 'rc=$?; [ $rc -eq 0 ] || stage "failed (exit $rc)"' EXIT
stage "setup checks (scripts/setup.sh)"
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# the scenarios on emulated hosts (network namespaces) must run here, not be skipped
export FERROVOD_REQUIRE_HOSTS=1
stage "cargo fmt and clippy"
cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
stage "build, then Rust unit tests, the C API program and the multi-rank scenarios under mpirun"
cargo build --release
cargo test --release
stage "the rdma feature (NIC discovery)"
# RDMA NIC discovery (cargo feature rdma, the ibverbs crate): built, linted and its tests run
cargo clippy --release --features rdma --lib -- -D warnings
cargo test --release --features rdma --lib rdma
# waiting threads poll only where each rank has 4 cores or more (not here): run the
# collectives and join scenarios once more with polling on
stage "collectives and join scenarios with polling on"
FERROVOD_POLL=1 cargo test --release --test mpi -- collectives
FERROVOD_POLL=1 cargo test --release --test mpi -- join
# fuzz the C boundary's argument checks, the wire/plan decoders, the settings parser, codecs
# and vote words, and enqueue/wait/release on a live one-rank runtime, for a bounded time
# (FUZZ_SECONDS each; longer by hand, see docs/fuzzing.md)
stage "fuzz targets (${FUZZ_SECONDS:-20} s each)"
(cd fuzz && cargo fmt --check)
fuzz_log=$(mktemp)
for target in wire enqueue settings live; do
  # fuzz/seeds/<target>: inputs that once failed, replayed first (regressions)
  # (git keeps no empty folder, so both are made here)
  mkdir -p "fuzz/corpus/$target" "fuzz/seeds/$target"
  if ! cargo fuzz run -s none -O "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="${FUZZ_SECONDS:-20}" >"$fuzz_log" 2>&1; then
    tail -n 80 "$fuzz_log"
    echo "fuzz target $target failed (its input is in fuzz/artifacts/$target/)" >&2
    exit 1
  fi
  echo "fuzz $target: $(grep -E '^Done' "$fuzz_log")"
done
rm -f "$fuzz_log"

stage "Python environments (scripts/setup-python.sh)"
bash scripts/setup-python.sh
# a test that desynchronises the ranks fails within a minute instead of the 600 s default
export HOROVOD_STALL_CHECK_TIME_SECONDS=20 HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=60 TF_CPP_MIN_LOG_LEVEL=2
py=(.venv/bin/python -m pytest -q -p no:cacheprovider --color=no)
for np in 2 4; do
  stage "TensorFlow, Keras and the Python core under mpirun -np $np"
  timeout 600 mpirun -np "$np" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
    "${py[@]}" tests/python/mpi
done
# the same suite with offline negotiation: plans freeze, and every other collective escapes
stage "the same under offline negotiation, np 2"
FERROVOD_NEGOTIATION=offline FERROVOD_PLAN_WARMUP_STEPS=2 timeout 600 mpirun -np 2 \
  --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
  -x FERROVOD_NEGOTIATION -x FERROVOD_PLAN_WARMUP_STEPS "${py[@]}" tests/python/mpi
# Horovod's TensorFlow ops communicate on every call whatever the job's FERROVOD_MULTISTEP says
stage "TensorFlow ops with FERROVOD_MULTISTEP=2"
FERROVOD_MULTISTEP=2 timeout 600 mpirun -np 2 --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 -x FERROVOD_MULTISTEP "${py[@]}" tests/python/mpi/test_tensorflow_ops.py
# PyTorch (CPU here; scripts/gpu/torch.sh runs the same file on CUDA tensors too)
for np in 2 4; do
  stage "PyTorch (Horovod's API, the DDP hook, torch.distributed) under mpirun -np $np"
  timeout 600 mpirun -np "$np" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
    "${py[@]}" tests/python/torch
done
# torch.distributed's ferrovod backend with offline negotiation (DDP's and FSDP's steps freeze
# into plans; every other call escapes them)
stage "torch.distributed under offline negotiation, np 2"
FERROVOD_NEGOTIATION=offline FERROVOD_PLAN_WARMUP_STEPS=2 timeout 600 mpirun -np 2 \
  --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
  -x FERROVOD_NEGOTIATION -x FERROVOD_PLAN_WARMUP_STEPS "${py[@]}" tests/python/torch/test_torch_distributed.py
# Horovod's PyTorch ops (collectives, DistributedOptimizer, the DDP hook) communicate on every
# call whatever FERROVOD_MULTISTEP says
stage "PyTorch with FERROVOD_MULTISTEP=2"
FERROVOD_MULTISTEP=2 timeout 600 mpirun -np 2 --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 -x FERROVOD_MULTISTEP "${py[@]}" tests/python/torch
stage "single-process Python tests (launcher, failures, docs)"
timeout 600 "${py[@]}" tests/python/single
# MXNet in its own environment (NumPy < 1.24): the engine-asynchronous ops under mpirun
mx=(.venv-mxnet/bin/python -m pytest -q -p no:cacheprovider --color=no)
for np in 2 4; do
  stage "MXNet under mpirun -np $np"
  timeout 600 mpirun -np "$np" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
    "${mx[@]}" tests/python/mxnet
done
# the combination matrix's sample: each framework, codec, mode and naming at least once, at np 2
# and 4, values against NumPy and RSS flat over 1,000 operations (the full matrix:
# bash scripts/matrix.sh; tests/matrix/README.md)
stage "the combination matrix's sample"
bash scripts/matrix.sh --sample
# MXNet's NaiveEngine runs each op inside its push: ops complete and fail at the call (the
# mismatch test that waits for the error later does not apply there)
stage "MXNet under NaiveEngine, np 2"
MXNET_ENGINE_TYPE=NaiveEngine timeout 600 mpirun -np 2 --oversubscribe --bind-to none \
  --mca mpi_yield_when_idle 1 -x MXNET_ENGINE_TYPE "${mx[@]}" tests/python/mxnet \
  -k "not where_waited_for"
stage "all passed"
