#!/usr/bin/env bash
# A/B of builds on a GPU machine, alternating them within one device call (the ResNet-50 figure
# moves by +-15 % between machines, less between runs on one machine). Builds nothing: copy
# each build's stripped `ferrovod-bench` into .gpu/ under its own name first.
# Usage: [NP=4] bash scripts/gpu/ab.sh ROUNDS VARIANT...   VARIANT = binary[:VAR=value[,VAR=value]]
# (NP ranks, 2 unless set)
# Prints one line per run (ratio, enqueue median, step and one-allreduce times); the probe of
# each variant's first run goes to stderr. Summarise with scripts/gpu/ab_summary.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_RUNTIME_CONNECT=${NCCL_RUNTIME_CONNECT:-0}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export FERROVOD_DATA_DIR=$PWD/.gpu/data
rounds=$1
shift
for i in $(seq "$rounds"); do
  for v in "$@"; do
    b=${v%%:*}
    envs=()
    if [ "$v" != "$b" ]; then
      for e in $(echo "${v#*:}" | tr ',' ' '); do envs+=(-x "$e"); done
    fi
    r=$(mpirun -np "${NP:-2}" --bind-to none -x NCCL_NVLS_ENABLE -x NCCL_RUNTIME_CONNECT -x FERROVOD_DATA_DIR "${envs[@]}" \
      "./.gpu/$b" gpu --min-bytes 2 --max-bytes 1 2>&1)
    echo "$v $(echo "$r" | grep -oE 'ratio [0-9.]+') $(echo "$r" | grep -oE 'enqueue \(us each\): median [0-9.]+') $(echo "$r" | grep -oE '(ferrovod|one NCCL allreduce) [0-9.]+ us' | tr '\n' ' ')"
    if [ "$i" = 1 ]; then
      echo "$r" | grep "step inside rank" | sed -n '1p;4p' | sed "s/^/$v /" >&2
    fi
  done
done
