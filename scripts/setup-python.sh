#!/usr/bin/env bash
# Creates the virtual environment .venv and installs ferrovod's Python packages into it
# (`pip install .` builds the Rust library through setuptools-rust), plus what the tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q pytest
.venv/bin/python -m pip install -q .
