#!/usr/bin/env bash
# Creates the virtual environment .venv and installs what the Python tests and the example use:
# TensorFlow and tf_keras (pinned), scikit-learn (the example's dataset), pytest, then
# ferrovod's own packages (`pip install .` builds the Rust library through setuptools-rust),
# and compiles the TensorFlow op library once.
#
#   bash scripts/setup-python.sh           install what is missing, then check again
#   bash scripts/setup-python.sh --check   print one line per missing requirement and exit 1
#
# Each requirement is checked by its installed distribution's exact version (importlib.metadata)
# in the venv's own interpreter, not by a file that looks alike. FERROVOD_VENV (tests only)
# replaces .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=install
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

venv=${FERROVOD_VENV:-.venv}
# distribution, pinned version ("" = any)
reqs=(
  "pytest|"
  "tensorflow-cpu|2.21.0"
  "tf_keras|2.21.0"
  "scikit-learn|"
)

# prints "name|wanted|found" for each requirement not satisfied, and "ferrovod||" and
# "horovod-dropin||" when ferrovod's own packages do not import
missing_python() {
  "$venv/bin/python" - "${reqs[@]}" <<'EOF'
import importlib.metadata as md, importlib.util, sys
for spec in sys.argv[1:]:
    name, want = spec.split("|")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = "not installed"
    if have == "not installed" or (want and have != want):
        print(f"{name}|{want}|{have}")
for mod in ("ferrovod", "horovod"):
    if importlib.util.find_spec(mod) is None:
        print(f"{mod}||not installed")
EOF
}

check() {
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup-python: missing: virtual environment $venv (python3 -m venv $venv)" >&2
    return 1
  fi
  local out
  out=$(missing_python)
  [ -z "$out" ] && return 0
  local line name want have
  while IFS= read -r line; do
    IFS='|' read -r name want have <<<"$line"
    if [ -n "$want" ]; then
      echo "setup-python: missing: $name==$want in $venv (found: $have)" >&2
    else
      echo "setup-python: missing: $name in $venv ($have)" >&2
    fi
  done <<<"$out"
  return 1
}

if [ "$mode" = check ]; then
  rc=0
  bash scripts/setup.sh --check || rc=1
  check || rc=1
  exit $rc
fi

bash scripts/setup.sh
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
wanted=()
while IFS= read -r line; do
  [ -z "$line" ] && continue
  IFS='|' read -r name want _ <<<"$line"
  case "$name" in
    ferrovod|horovod) ;;
    *) wanted+=("$name${want:+==$want}") ;;
  esac
done <<<"$(missing_python)"
if [ ${#wanted[@]} -gt 0 ]; then
  echo "setup-python: installing ${wanted[*]}" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "${wanted[@]}"
fi
# always: the Rust library is rebuilt from the source tree as it is now
"$venv/bin/python" -m pip install -q .
check || { echo "setup-python: still missing after installing; see the lines above" >&2; exit 1; }
# compile the TensorFlow op library now (it is cached per TensorFlow version), not in every rank
"$venv/bin/python" -c "import ferrovod.tensorflow"
