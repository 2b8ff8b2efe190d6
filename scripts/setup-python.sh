#!/usr/bin/env bash
# Creates the virtual environments the Python tests and the example use, and installs into them:
#   .venv        TensorFlow and tf_keras (pinned), PyTorch 2.15.0 (from PyPI with its CUDA
#                libraries: about 3 GB, a minute here), scikit-learn (the example's dataset), pytest;
#   .venv-mxnet  MXNet 1.9.1 with NumPy 1.23.5 (MXNet imports only with NumPy < 1.24, which
#                TensorFlow 2.21 does not accept: hence its own environment), scikit-learn
#                (pinned to one that works with that NumPy; the Gluon example's dataset), pytest;
# then ferrovod's own packages into both (one wheel: setuptools-rust builds the Rust library
# once), and compiles each framework's op library once.
#
#   bash scripts/setup-python.sh           install what is missing, then check again
#   bash scripts/setup-python.sh --check   print one line per missing requirement and exit 1
#
# Each requirement is checked by its installed distribution's exact version (importlib.metadata)
# in the venv's own interpreter, not by a file that looks alike. FERROVOD_VENV and
# FERROVOD_MXNET_VENV (tests only) replace .venv and .venv-mxnet.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=install
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

tf_venv=${FERROVOD_VENV:-.venv}
mx_venv=${FERROVOD_MXNET_VENV:-.venv-mxnet}
# distribution, pinned version ("" = any)
tf_reqs=(
  "pytest|"
  "tensorflow-cpu|2.21.0"
  "tf_keras|2.21.0"
  "scikit-learn|"
  "torch|2.15.0"
)
mx_reqs=(
  "pytest|"
  "mxnet|1.9.1"
  "numpy|1.23.5"
  "scikit-learn|1.5.2"
)

# prints "name|wanted|found" for each requirement not satisfied, "ferrovod||" or "horovod||"
# when ferrovod's own packages do not import, and "ferrovod-takeover.pth||" when the wheel's
# start-up hook is not in site-packages (in venv $1, for the requirements after it)
missing_python() {
  local venv=$1
  shift
  "$venv/bin/python" - "$@" <<'EOF'
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
import os, sysconfig
if not os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], "ferrovod-takeover.pth")):
    print("ferrovod-takeover.pth||not installed")
EOF
}

# (venv $1, requirements after it)
check() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup-python: missing: virtual environment $venv (python3 -m venv $venv)" >&2
    return 1
  fi
  local out
  out=$(missing_python "$venv" "$@")
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
  check "$tf_venv" "${tf_reqs[@]}" || rc=1
  check "$mx_venv" "${mx_reqs[@]}" || rc=1
  exit $rc
fi

# installs what venv $1 misses of the requirements after it (not ferrovod's own packages)
install_missing() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  local wanted=() line name want
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    IFS='|' read -r name want _ <<<"$line"
    case "$name" in
      ferrovod|horovod|ferrovod-takeover.pth) ;;
      *) wanted+=("$name${want:+==$want}") ;;
    esac
  done <<<"$(missing_python "$venv" "$@")"
  if [ ${#wanted[@]} -gt 0 ]; then
    echo "setup-python: installing ${wanted[*]} into $venv" >&2
    # every pin of the environment on the same command line, so that pip resolves the new
    # packages' dependencies around them (never upgrading MXNet's NumPy)
    local pins=() spec
    for spec in "$@"; do
      IFS='|' read -r name want <<<"$spec"
      [ -n "$want" ] && pins+=("$name==$want")
    done
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "${wanted[@]}" "${pins[@]}"
  fi
}

bash scripts/setup.sh
install_missing "$tf_venv" "${tf_reqs[@]}"
install_missing "$mx_venv" "${mx_reqs[@]}"
# always: the Rust library is rebuilt from the source tree as it is now, once, as one wheel
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$tf_venv/bin/python" -m pip wheel -q --no-deps -w "$wheels" .
for venv in "$tf_venv" "$mx_venv"; do
  "$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$wheels"/ferrovod-*.whl
  # its dependencies, where the environment lacks them (MXNet's NumPy stays as pinned)
  "$venv/bin/python" -m pip install -q cloudpickle packaging
done
check "$tf_venv" "${tf_reqs[@]}" &&
  check "$mx_venv" "${mx_reqs[@]}" ||
  { echo "setup-python: still missing after installing; see the lines above" >&2; exit 1; }
# compile the op libraries now (cached per framework version), not in every rank; the
# frameworks' import notices are shown only if the import fails
for probe in "$tf_venv/bin/python -c import ferrovod.tensorflow" "$mx_venv/bin/python -c import ferrovod.mxnet"; do
  read -r exe flag code <<<"$probe"
  out=$("$exe" "$flag" "$code" 2>&1) || { echo "$out" >&2; echo "setup-python: $code failed" >&2; exit 1; }
done
