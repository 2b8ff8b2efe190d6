#!/usr/bin/env bash
# Installs the system packages ferrovod's build and tests use on a fresh Debian/Ubuntu machine,
# and cargo-fuzz (the fuzz targets' runner, from crates.io).
# Each requirement is checked for exactly what uses it (the command the build runs, the library
# bindgen loads, the header the shim includes), not for something that merely looks alike: the
# image ships libclang-cpp.so.14, which bindgen cannot use, without libclang.so, which it loads.
#
#   bash scripts/setup.sh           install what is missing (apt), then check again
#   bash scripts/setup.sh --check   print one line per missing requirement and exit 1; install nothing
#
# FERROVOD_SETUP_LIBCLANG_DIRS (tests only) replaces the directories searched for libclang.
set -euo pipefail

mode=install
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

missing=()   # "package|what is missing"
pkgs=()

have() { command -v "$1" >/dev/null 2>&1; }

# clang-sys (bindgen) loads libclang.so or libclang-<version>.so from LIBCLANG_PATH or these
# directories; libclang-cpp.so.N is a different library and does not count.
libclang_found() {
  local dirs=${FERROVOD_SETUP_LIBCLANG_DIRS:-"${LIBCLANG_PATH:-} /usr/lib/llvm-*/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib"}
  local d f
  for d in $dirs; do
    for f in "$d"/libclang.so "$d"/libclang-[0-9]*.so; do
      [ -e "$f" ] && return 0
    done
  done
  return 1
}

# bindgen parses mpi.h with clang's own builtin headers (stddef.h, stdarg.h …)
clang_headers_found() {
  local dirs=${FERROVOD_SETUP_LIBCLANG_DIRS:-"/usr/lib/llvm-*/lib"}
  local d
  for d in $dirs; do
    ls "$d"/clang/*/include/stddef.h >/dev/null 2>&1 && return 0
  done
  return 1
}

# mpi.h where the wrapper compiler says it is (rsmpi's probe and build.rs both ask mpicc)
mpi_header_found() {
  have mpicc || return 1
  local d
  for d in $(mpicc --showme:incdirs 2>/dev/null); do
    [ -f "$d/mpi.h" ] && return 0
  done
  return 1
}

check_all() {
  missing=()
  have mpirun || missing+=("openmpi-bin|command mpirun (launches every multi-rank test)")
  have mpicc || missing+=("libopenmpi-dev|command mpicc (rsmpi's build probe, the MPI constants shim)")
  mpi_header_found || missing+=("libopenmpi-dev|mpi.h in mpicc --showme:incdirs")
  libclang_found || missing+=("libclang-dev|libclang.so or libclang-<N>.so (bindgen loads it; libclang-cpp.so does not count)")
  clang_headers_found || missing+=("libclang-dev|clang builtin headers (<llvm>/lib/clang/<N>/include/stddef.h)")
  have cc || missing+=("build-essential|command cc (C API test program)")
  have g++ || missing+=("build-essential|command g++ (TensorFlow op library)")
  have pkg-config || missing+=("pkg-config|command pkg-config (rsmpi's build probe)")
  # emulated hosts (scripts/hosts/): network namespaces, veth links, tc's token bucket
  have ip || missing+=("iproute2|command ip (network namespaces of the emulated hosts)")
  have tc || missing+=("iproute2|command tc (rate limits of the emulated hosts' links)")
  have unshare || missing+=("util-linux|command unshare (each emulated host's own hostname)")
  # the rdma feature builds rdma-core (ibverbs-sys): cmake and libnl's route library
  have cmake || missing+=("cmake|command cmake (rdma-core, built by the rdma feature's ibverbs-sys)")
  [ -f /usr/include/libnl3/netlink/route/link.h ] || missing+=("libnl-3-dev|libnl3/netlink/route/link.h (rdma-core's netlink headers)")
  ls /usr/lib/*/libnl-route-3.so >/dev/null 2>&1 || missing+=("libnl-route-3-dev|libnl-route-3.so (rdma-core links it)")
  if ! have python3; then
    missing+=("python3|command python3")
  elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    missing+=("python3-venv|python3 modules venv and ensurepip (creates .venv)")
  fi
  if ! have cargo; then
    missing+=("rustup|command cargo: install Rust with rustup (https://rustup.rs)")
  elif ! cargo fuzz --version >/dev/null 2>&1; then
    missing+=("cargo:cargo-fuzz|cargo fuzz (the fuzz targets in fuzz/)")
  fi
}

report() {
  local m p
  for m in "${missing[@]}"; do
    p=${m%%|*}
    case "$p" in
      cargo:*) echo "setup: missing: ${m#*|} — cargo install ${p#cargo:} --locked" >&2 ;;
      *) echo "setup: missing: ${m#*|} — Debian package $p" >&2 ;;
    esac
  done
}

check_all
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$mode" = check ]; then
  report
  exit 1
fi

crates=()
for m in "${missing[@]}"; do
  p=${m%%|*}
  case "$p" in
    rustup) continue ;;
    cargo:*) crates+=("${p#cargo:}"); continue ;;
  esac
  case " ${pkgs[*]:-} " in *" $p "*) ;; *) pkgs+=("$p") ;; esac
done
if [ ${#pkgs[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${pkgs[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi
if [ ${#crates[@]} -gt 0 ]; then
  echo "setup: installing ${crates[*]} (cargo install)" >&2
  cargo install -q --locked "${crates[@]}"
fi
check_all
if [ ${#missing[@]} -gt 0 ]; then
  report
  echo "setup: still missing after installing; see the lines above" >&2
  exit 1
fi
