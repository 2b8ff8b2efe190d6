#!/usr/bin/env bash
# One job on fresh emulated hosts, removed again on every exit path:
#   bash scripts/hosts/run.sh N PER RATE [mpirun options] program [args]
# (RATE "none": unlimited links.)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
n=${1:?usage: run.sh N PER RATE program}
per=${2:?usage: run.sh N PER RATE program}
rate=${3:?usage: run.sh N PER RATE program}
shift 3
trap 'bash "$here/down.sh"' EXIT
trap 'exit 130' INT TERM
[ "$rate" = none ] && rate=
bash "$here/up.sh" "$n" $rate >&2
bash "$here/mpirun.sh" "$n" "$per" "$@"
