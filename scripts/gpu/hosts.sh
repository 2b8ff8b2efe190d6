#!/usr/bin/env bash
# scripts/hosts/run.sh on the GPU machine: emulated hosts over its CPUs (a core or more per
# host, where the development machine has two in all), for the slow-link benchmarks whose
# ranks compute on the CPU. That machine has no iproute2 (scripts/gpu/prepare.sh carries ip
# and tc in .gpu/iproute2), and its Open MPI launches on the local node only (OMPI_MCA_plm
# isolated): the hosts need rsh's launcher, through scripts/hosts/rsh.sh.
#
#   bash scripts/gpu/hosts.sh N PER RATE [mpirun options] program [args]
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .gpu/iproute2/bin/ip ] || { echo "hosts.sh: no .gpu/iproute2; run scripts/gpu/prepare.sh where ip and tc exist" >&2; exit 2; }
export PATH=$PWD/.gpu/iproute2/bin:$PATH OMPI_MCA_plm=rsh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec bash scripts/hosts/run.sh "$@"
