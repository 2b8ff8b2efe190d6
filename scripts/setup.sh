#!/usr/bin/env bash
# Installs what ferrovod needs on a fresh Debian/Ubuntu machine: Open MPI (runtime and headers,
# for rsmpi and the mpicc-built shim), libclang (bindgen), a C compiler and Python 3 (tests).
set -euo pipefail
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
[ -n "$(ls /usr/lib/llvm-*/lib/libclang*.so* 2>/dev/null | head -n1)" ] || need+=(libclang-dev clang)
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v python3 >/dev/null 2>&1 || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || {
  echo "setup: cargo not found; install Rust with rustup (https://rustup.rs)" >&2
  exit 1
}
