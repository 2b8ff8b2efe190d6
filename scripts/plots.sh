#!/usr/bin/env bash
# Draws BENCHMARKS.md's plots (benchmarks/plots/*.png) from the recorded results in
# benchmarks/results/*.json, with matplotlib in .venv-plots (made here when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-plots
if ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
  echo "plots: installing matplotlib into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "matplotlib>=3.8"
fi
"$venv/bin/python" scripts/plots.py
