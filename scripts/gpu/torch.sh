#!/usr/bin/env bash
# ferrovod.torch on a GPU machine, building nothing (run scripts/gpu/prepare.sh on the
# development machine first and carry .gpu/: it holds ferrovod's wheel and pytest's, which
# scripts/gpu/env.sh installs here with pip):
#   tests   tests/python/torch on CPU and CUDA tensors under mpirun (FERROVOD_TEST_GPU=1:
#           CUDA must be there), np 2;
#   bench   scripts/gpu/bench_torch.py: ResNet-50 synthetic training, fp32 and bf16 (one job
#           each), ferrovod vs DDP vs no communication (and BERT-base with `bench-bert`).
#   horovod Horovod's own test_torch.py (staged by FERROVOD_HOROVOD_TREE=<tree> prepare.sh).
# Usage: bash scripts/gpu/torch.sh [tests|bench|bench-bert|horovod|all] (default all). Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
source scripts/gpu/env.sh
export HOROVOD_STALL_CHECK_TIME_SECONDS=${HOROVOD_STALL_CHECK_TIME_SECONDS:-20}
export HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS:-60}
echo "# $(date -u +%F) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$ngpu, torch $(python3 -c 'import torch; print(torch.__version__)')"
mpi=(mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE -x NCCL_RUNTIME_CONNECT
  -x PYTHONUNBUFFERED -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x HOROVOD_STALL_CHECK_TIME_SECONDS
  -x HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # on time, SIGINT: pytest still prints which tests failed before the job ends
  FERROVOD_TEST_GPU=1 timeout -s INT -k 30 900 "${mpi[@]}" -x FERROVOD_TEST_GPU \
    python3 -m pytest -q -p no:cacheprovider --color=no -rfEs tests/python/torch 2>&1 |
    tee "$out/torch-tests.log" | grep -v "^$" | tail -30 || rc=1
  # pytest's summary line only: a warning's text may say "errors"
  grep -qE "[0-9]+ (failed|errors?)\b" "$out/torch-tests.log" && rc=1
  # the wait left to the device, in jobs of their own: the fault delays rank 0's GPU batches;
  # with two channels, each channel's first batch opens communicators of its own
  for channels in 1 2; do
    FERROVOD_TEST_FAULT=slow_gpu_launch:0 FERROVOD_TORCH_DEVICE_WAIT=1 CUDA_MODULE_LOADING=EAGER \
      FERROVOD_CHANNELS=$channels timeout -s INT -k 30 300 mpirun -np "$(( ngpu < 2 ? 1 : 2 ))" "${mpi[@]:3}" \
      -x FERROVOD_TEST_FAULT -x FERROVOD_TORCH_DEVICE_WAIT -x CUDA_MODULE_LOADING -x FERROVOD_CHANNELS \
      python3 -m pytest -q -p no:cacheprovider --color=no -rfEs tests/python/torch/test_device_wait.py 2>&1 |
      tee "$out/torch-device-wait-$channels.log" | tail -5 || rc=1
    grep -qE "[0-9]+ (failed|errors?)\b|no tests ran" "$out/torch-device-wait-$channels.log" && rc=1
  done
  # forced under lazy kernel loading, the same wait deadlocks: the watch ends the job, saying why
  FERROVOD_TEST_FAULT=slow_gpu_launch:0 FERROVOD_TORCH_DEVICE_WAIT=force CUDA_MODULE_LOADING=LAZY \
    HOROVOD_STALL_CHECK_TIME_SECONDS=2 HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5 timeout -k 10 120 \
    mpirun -np 1 "${mpi[@]:3}" -x FERROVOD_TEST_FAULT -x FERROVOD_TORCH_DEVICE_WAIT -x CUDA_MODULE_LOADING \
    python3 tests/python/torch/device_wait_deadlock.py >"$out/torch-device-wait-watch.log" 2>&1
  watched=$?
  if [ "$watched" -ne 0 ] && grep -q "waited on the device for a collective for more than 5 s" "$out/torch-device-wait-watch.log"; then
    echo "device wait under lazy loading: ended by the watch, as expected"
  else
    echo "device wait under lazy loading: not ended by the watch (exit $watched)"; rc=1
  fi
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # one job per precision: within one job, bf16 after fp32 ran slower for DDP and ferrovod
  # alike (BENCHMARKS.md)
  for precision in fp32 bf16; do
    timeout 450 "${mpi[@]}" python3 scripts/gpu/bench_torch.py --precisions $precision 2>&1 |
      tee -a "$out/torch-bench.log" || rc=1
  done
fi
if [ "$what" = horovod ]; then
  # Horovod's test_torch.py (FERROVOD_HOROVOD_TREE=... scripts/gpu/prepare.sh put it in .gpu/htest);
  # each rank's log is copied to a flat file in $out
  (cd .gpu/htest && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 900 "${mpi[@]}" -x PYTHONPATH --output-filename "$out/htest" \
    python3 -m pytest -q -p no:cacheprovider --color=no -rfEs test_torch.py >/dev/null 2>&1)
  for r in 0 1; do cp "$out/htest/1/rank.$r/stdout" "$out/horovod-torch-rank$r.log"; done
  rm -rf "$out/htest"
  tail -1 "$out/horovod-torch-rank0.log"
  grep "^FAILED" "$out/horovod-torch-rank0.log" | cut -c1-200
fi
if [ "$what" = bench-bert ]; then
  timeout 900 "${mpi[@]}" python3 scripts/gpu/bench_torch.py --model bert --batch 32 2>&1 |
    tee "$out/torch-bench-bert.log" || rc=1
fi
exit $rc
