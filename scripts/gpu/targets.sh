#!/usr/bin/env bash
# The GPU figures the project's performance targets are judged by, at each np the machine
# allows, each line checked against its goal by scripts/gpu/targets.py at the end. Builds
# nothing: run scripts/gpu/prepare.sh on the development machine first and carry .gpu/.
#   core   ferrovod-bench gpu at 256 MiB (back to back and one tensor at a time) and the
#          ResNet-50 set against one NCCL allreduce; torch_allreduce.py at the same sizes;
#   train  bench_torch.py, ResNet-50: the model alone, DDP over NCCL, DDP over the `ferrovod`
#          group, horovod.torch on ferrovod; one job per precision (fp32, bf16);
#   bert   the same for BERT-base (batch 32), without DDP over the group;
#   fsdp   bench_torch_distributed.py --only fsdp: FSDP2 over `ferrovod` against NCCL, fp32 and
#          bf16, and bf16 again with the wait left to the device (FERROVOD_TORCH_DEVICE_WAIT=1);
#   all    every phase (longer than one call to a lent machine allows at np 4: run phases).
# Usage: bash scripts/gpu/targets.sh PHASE [NP ...]   (default: 2 4 8 up to the GPUs there;
# np 1 on a one-GPU machine, where the lines show the host's part alone). Each phase appends
# its lines to $OUT/targets.txt (phases run in one $OUT add up; a fresh $OUT starts afresh);
# `python3 scripts/gpu/targets.py $OUT/targets.txt` checks them.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
shift || true
source scripts/gpu/env.sh
export FERROVOD_DATA_DIR=$PWD/.gpu/data
nps=("$@")
if [ ${#nps[@]} -eq 0 ]; then
  for np in 2 4 8; do [ "$np" -le "$ngpu" ] && nps+=("$np"); done
  [ ${#nps[@]} -eq 0 ] && nps=(1)
fi
lines=$out/targets.txt
echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$ngpu: $what at np ${nps[*]}" | tee -a "$lines"
rc=0
# runs a job, its log in $out/$1.log; its target lines (tagged with $tag where set) to $lines
job() {
  local log=$out/$1.log status=0
  shift
  timeout -k 20 420 "$@" >"$log" 2>&1 || { status=$?; echo "failed (exit $status): $* (see $log)"; }
  grep -E '^(gpu|cpu) np=[0-9]+ .* = ([0-9.]+|nan|inf)' "$log" | sed "s/\$/${tag:+ [$tag]}/" | tee -a "$lines"
  return $status
}
# the device wait is off, and kernels load lazily (CUDA's default), unless a job says otherwise
export FERROVOD_TORCH_DEVICE_WAIT=${FERROVOD_TORCH_DEVICE_WAIT:-0} CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-LAZY}
mpi() {
  local np=$1
  shift
  echo mpirun -np "$np" --bind-to none -x NCCL_NVLS_ENABLE -x NCCL_RUNTIME_CONNECT -x FERROVOD_DATA_DIR \
    -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x PYTHONUNBUFFERED -x FERROVOD_TORCH_DEVICE_WAIT -x CUDA_MODULE_LOADING "$@"
}
for np in "${nps[@]}"; do
  if [ "$what" = core ] || [ "$what" = all ]; then
    : >"$out/core-$np.jsonl"
    job "core-bench-$np" $(mpi "$np") ./.gpu/ferrovod-bench gpu --min-bytes 256M --max-bytes 256M || rc=1
    job "core-torch-$np" $(mpi "$np") python3 scripts/gpu/torch_allreduce.py .gpu/data/resnet50_grads.tsv \
      $((256 << 20)) $((256 << 20)) || rc=1
    cat "$out/core-bench-$np.log" "$out/core-torch-$np.log" | grep '^JSON ' | sed 's/^JSON //' >"$out/core-$np.jsonl"
    python3 scripts/gpu/summary.py "$out/core-$np.jsonl" >"$out/core-$np.txt" || rc=1
    grep -E '^gpu np=' "$out/core-$np.txt" | tee -a "$lines"
  fi
  if [ "$what" = train ] || [ "$what" = all ]; then
    for p in fp32 bf16; do
      job "train-$p-$np" $(mpi "$np") python3 scripts/gpu/bench_torch.py --precisions $p \
        --modes nocomm,ddp,ddp_ferrovod,ferrovod --rounds 2 --steps 20 || rc=1
    done
  fi
  if [ "$what" = bert ] || [ "$what" = all ]; then
    for p in fp32 bf16; do
      job "bert-$p-$np" $(mpi "$np") python3 scripts/gpu/bench_torch.py --model bert --batch 32 \
        --precisions $p --modes nocomm,ddp,ferrovod --rounds 2 --steps 15 || rc=1
    done
  fi
  if [ "$what" = fsdp ] || [ "$what" = all ]; then
    fsdp=(python3 scripts/bench_torch_distributed.py --device cuda --only fsdp --rounds 5 --steps 8)
    job "fsdp-fp32-$np" $(mpi "$np") "${fsdp[@]}" || rc=1
    job "fsdp-bf16-$np" $(mpi "$np") "${fsdp[@]}" --bf16 || rc=1
    (export FERROVOD_TORCH_DEVICE_WAIT=1 CUDA_MODULE_LOADING=EAGER tag="device wait"
     job "fsdp-bf16-wait-$np" $(mpi "$np") "${fsdp[@]}" --bf16) || rc=1
  fi
done
# (its exit status says whether every goal was met; this script's, whether every job ran)
python3 scripts/gpu/targets.py "$lines"
exit $rc
