#!/usr/bin/env bash
# Creates the virtual environment .venv and installs ferrovod's Python packages into it
# (`pip install .` builds the Rust library through setuptools-rust), plus TensorFlow,
# scikit-learn (the example's dataset) and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q pytest "tensorflow-cpu==2.21.0" "tf_keras==2.21.0" scikit-learn
.venv/bin/python -m pip install -q .
# compile the TensorFlow op library now (it is cached per TensorFlow version), not in every rank
.venv/bin/python -c "import ferrovod.tensorflow"
