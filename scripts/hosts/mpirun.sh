#!/usr/bin/env bash
# mpirun across the emulated hosts that up.sh made: PER ranks on each of N hosts, rank r on host
# r / PER. Shared memory inside a host; between hosts only TCP over the (rate-limited) links.
# Extra mpirun options may precede the program; environment variables are forwarded with -x as
# usual.
#
#   bash scripts/hosts/mpirun.sh N PER [mpirun options] program [args]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
n=${1:?usage: mpirun.sh N PER program}
per=${2:?usage: mpirun.sh N PER program}
shift 2
hosts=$(for i in $(seq 1 "$n"); do printf '10.78.0.%d:%d,' "$i" "$per"; done)
exec ip netns exec fvhost0 mpirun --allow-run-as-root -np $((n * per)) --host "${hosts%,}" \
  --mca plm_rsh_agent "$here/rsh.sh" --mca btl vader,tcp,self \
  --mca btl_tcp_if_include 10.78.0.0/24 --mca oob_tcp_if_include 10.78.0.0/24 \
  --bind-to none --mca mpi_yield_when_idle 1 -x PATH "$@"
