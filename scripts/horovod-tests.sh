#!/usr/bin/env bash
# Runs Horovod's own TensorFlow test files against ferrovod's drop-in (the .venv that
# scripts/setup-python.sh makes), each under `mpirun -np 2`, and prints one table of counts.
# Horovod's files are copied from a Horovod source tree you have into a scratch directory and
# never into this repository. See docs/horovod-tests.md for the last run's figures and causes.
#
#   scripts/horovod-tests.sh [--keras 2|3|both] HOROVOD_TREE [TEST_FILE ...]
#
# HOROVOD_TREE: a Horovod checkout (the figures in the doc are from tag v0.28.1). TEST_FILE:
# names under test/parallel (default: every TensorFlow file there). --keras: which Keras
# `tf.keras` is — 2 (tf_keras, TF_USE_LEGACY_KERAS=1: the Keras that Horovod's tests were written
# for), 3 (TensorFlow's default), or both (default). FERROVOD_HOROVOD_TESTS_DIR: the scratch
# directory (default: a new one under /tmp); each rank's log is kept there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
keras=both
if [[ ${1:-} == --keras ]]; then
  keras=${2:?--keras takes 2, 3 or both}
  shift 2
fi
case $keras in
  2) modes=(2) ;;
  3) modes=(3) ;;
  both) modes=(2 3) ;;
  *) echo "--keras takes 2, 3 or both, not '$keras'" >&2; exit 2 ;;
esac
tree=${1:?usage: scripts/horovod-tests.sh [--keras 2|3|both] HOROVOD_TREE [TEST_FILE ...]}
shift
if [[ ! -f $tree/test/parallel/base_test_tensorflow.py || ! -f $tree/test/utils/common.py ]]; then
  echo "$tree is not a Horovod source tree (no test/parallel/base_test_tensorflow.py or test/utils/common.py)" >&2
  exit 2
fi
files=("$@")
if ((${#files[@]} == 0)); then
  for f in test_tensorflow.py test_tensorflow_process_sets.py test_tensorflow_process_sets_dynamic.py \
    test_tensorflow2_keras.py test_tensorflow2_keras_process_sets.py test_tensorflow_keras.py \
    test_keras.py test_xla.py test_xla_process_sets.py test_adasum_tensorflow.py; do
    [[ -f $tree/test/parallel/$f ]] && files+=("$f")
  done
fi
for f in "${files[@]}"; do
  [[ -f $tree/test/parallel/$f ]] || { echo "no test/parallel/$f in $tree" >&2; exit 2; }
done

python=$root/.venv/bin/python
if ! "$python" -c "import horovod.tensorflow" 2>/dev/null; then
  echo "the drop-in does not import from $root/.venv: run scripts/setup-python.sh first" >&2
  exit 2
fi
# the tests' own requirement (not ferrovod's): installed into .venv when missing
if ! "$python" -c "import parameterized" 2>/dev/null; then
  "$python" -m pip install -q parameterized
fi

work=${FERROVOD_HOROVOD_TESTS_DIR:-$(mktemp -d /tmp/ferrovod-horovod-tests.XXXXXX)}
mkdir -p "$work/test/parallel" "$work/test/utils" "$work/shims" "$work/logs" "$work/results"
cp "$tree/test/conftest.py" "$work/test/" 2>/dev/null || true
cp "$tree/test/utils/common.py" "$work/test/utils/"
cp "$tree/test/parallel/base_test_tensorflow.py" "${files[@]/#/$tree/test/parallel/}" "$work/test/parallel/"
# the tests import the `mock` backport; `parameterized` reads its version
printf 'from unittest.mock import *  # noqa: F401,F403\nversion_info = (5, 0, 0)\n' >"$work/shims/mock.py"
cp "$root/scripts/horovod-tests/yardstick.py" "$work/shims/ferrovod_yardstick.py"
version=$(git -C "$tree" describe --tags 2>/dev/null || echo "unknown version")
echo "Horovod tests from $tree ($version), logs in $work/logs"

if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export PYTHONPATH=$work/shims:$work/test/utils:. TF_CPP_MIN_LOG_LEVEL=2
for f in "${files[@]}"; do
  for mode in "${modes[@]}"; do
    run=${f%.py}.keras$mode
    legacy=$([[ $mode == 2 ]] && echo 1 || echo 0)
    echo "running $f with Keras $mode ..."
    rm -rf "$work/logs/$run" "$work/results/$run".*
    (cd "$work/test/parallel" &&
      TF_USE_LEGACY_KERAS=$legacy FERROVOD_YARDSTICK_OUT=$work/results/$run \
        timeout 1200 mpirun -np 2 --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
        -x PYTHONPATH -x TF_USE_LEGACY_KERAS -x TF_CPP_MIN_LOG_LEVEL -x FERROVOD_YARDSTICK_OUT \
        --output-filename "$work/logs/$run" \
        "$python" -m pytest -q -p no:cacheprovider --color=no -rfEs -p ferrovod_yardstick "$f" \
        >/dev/null 2>&1) || true
  done
done
"$python" "$root/scripts/horovod-tests/table.py" "$work" "${modes[@]/#/--keras=}" "${files[@]}"
