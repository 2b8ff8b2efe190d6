#!/usr/bin/env bash
# PyTorch's own distributed tests (the collective, subgroup and DDP tests of
# torch.testing._internal.distributed.distributed_test, which ship inside the torch package) on
# the `ferrovod` backend, one MPI rank per test process (scripts/torch-tests/runner.py), then a
# table of the results (scripts/torch-tests/table.py). docs/torch-distributed.md holds the last
# table and explains its failures.
# Usage: bash scripts/torch-tests.sh [-n NP] [--as gloo] [-k PART_OF_A_NAME]...
#   (default np 2, every test; --as gloo: the suite as it runs for gloo, its groups taken over
#   by ferrovod's, FERROVOD_TORCH_TAKEOVER)
# Results in ${OUT:-/tmp/ferrovod-torch-tests}; PYTHON chooses the interpreter (default .venv's).
set -uo pipefail
cd "$(dirname "$0")/.."
np=2
args=()
while [ $# -gt 0 ]; do
  case $1 in
    -n) np=$2; shift 2 ;;
    --as) export TORCH_TESTS_AS=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
py=${PYTHON:-.venv/bin/python}
# PyTorch's test utilities import expecttest, which torch does not depend on
"$py" -c "import expecttest" 2>/dev/null || "$py" -m pip install -q expecttest
out=${OUT:-/tmp/ferrovod-torch-tests}
rm -rf "$out"
mkdir -p "$out"/{barrier,test_dir,init_dir,runner}
export TORCH_TESTS_AS=${TORCH_TESTS_AS:-ferrovod}
export TEMP_DIR=$out OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# a test whose ranks disagree ends in ferrovod's stall error within half a minute
export HOROVOD_STALL_CHECK_TIME_SECONDS=${HOROVOD_STALL_CHECK_TIME_SECONDS:-10}
export HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS:-30}
# a job that ends inside a test (a crash, or a test past the runner's timeout) is started again
# after it: every rank's results so far are what the next job skips
for attempt in $(seq 1 100); do
  cat "$out"/results.*.jsonl >"$out/done.jsonl" 2>/dev/null
  before=$(wc -l <"$out/done.jsonl")
  if mpirun -np "$np" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
    -x TEMP_DIR -x TORCH_TESTS_AS -x HOROVOD_STALL_CHECK_TIME_SECONDS -x HOROVOD_STALL_SHUTDOWN_TIME_SECONDS \
    "$py" scripts/torch-tests/runner.py --done "$out/done.jsonl" --job "$attempt" "${args[@]}"; then
    break
  fi
  echo "torch-tests: the job ended inside a test (attempt $attempt); going on after it" >&2
  # the test it ended in gets a result of its own if no rank wrote one
  "$py" - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
done = set()
for name in os.listdir(out):
    if name.startswith("results."):
        with open(os.path.join(out, name)) as f:
            done |= {json.loads(l)["test"] for l in f if l.strip()}
for name in sorted(os.listdir(out)):
    if name.startswith("current."):
        test = open(os.path.join(out, name)).read().strip()
        if test and test not in done:
            with open(os.path.join(out, "results.crash.jsonl"), "a") as f:
                f.write(json.dumps({"test": test, "rank": int(name.split(".")[1]), "outcome": "failed",
                                    "why": "the job ended during this test"}) + "\n")
            done.add(test)
PY
  if [ "$(cat "$out"/results.*.jsonl 2>/dev/null | wc -l)" -eq "$before" ]; then
    echo "torch-tests: no test ran in that job; stopping" >&2
    break
  fi
done
"$py" scripts/torch-tests/table.py "$out" | tee "$out/table.md"
