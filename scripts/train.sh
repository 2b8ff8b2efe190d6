#!/usr/bin/env bash
# The main job: set up everything on a fresh machine, then train a Keras model on
# scikit-learn's digits across 4 local ranks through `import horovod.tensorflow.keras as hvd`
# and `horovodrun`. Prints per-epoch progress, final accuracy and samples/s.
# NP=2 bash scripts/train.sh trains on 2 ranks; extra arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-python.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=3
# TensorFlow prints notices at import on every rank, before its log settings apply (oneDNN is
# on, no CUDA driver on a machine without GPUs): dropped here, every other line kept
quiet='^(\[[0-9]+,[0-9]+\]<stderr>:)?(WARNING: All log messages before absl::InitializeLog\(\) is called|I0000 [0-9:. ]+ +[0-9]+ (port|cudart_stub)\.cc:[0-9]+\])'
.venv/bin/horovodrun -np "${NP:-4}" .venv/bin/python examples/keras_digits.py "$@" \
  2> >(grep -vE "$quiet" >&2)
